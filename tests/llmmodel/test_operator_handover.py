"""Which manager owns a Deployment's ``replicas``, as ``managedFields`` says (the handover to an
autoscaler only happens when the operator's server-side apply does)."""

from __future__ import annotations

from typing import Any

import pytest

from llmmodel.kube_api import FIELD_MANAGER
from llmmodel.operator_handover import owns_replicas

REPLICAS: dict[str, Any] = {"f:spec": {"f:replicas": {}, "f:template": {}}}


def live(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"managedFields": list(entries)}, "spec": {"replicas": 3}}


@pytest.mark.parametrize(("obj", "owned"), [
    (live({"manager": FIELD_MANAGER, "operation": "Apply", "fieldsV1": REPLICAS}), True),
    # Applied by the operator, but without replicas (already handed over).
    (live({"manager": FIELD_MANAGER, "operation": "Apply",
           "fieldsV1": {"f:spec": {"f:template": {}}}}), False),
    # The HPA's scale update, or someone else's apply: not the operator's.
    (live({"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": REPLICAS}), False),
    (live({"manager": "kubectl", "operation": "Apply", "fieldsV1": REPLICAS}), False),
    (live({"manager": FIELD_MANAGER, "operation": "Update", "fieldsV1": REPLICAS}), False),
    (live(), False),
    ({"metadata": {}, "spec": {}}, False),
    (live({"manager": FIELD_MANAGER, "operation": "Apply"}), False),  # no fieldsV1
])
def test_only_the_operators_own_apply_of_replicas_counts(obj: dict[str, Any], owned: bool) -> None:
    assert owns_replicas(obj, FIELD_MANAGER) is owned
