"""One gateway per test module: starting Envoy and the services takes a few seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(default_doc(), str(tmp_path_factory.mktemp("gw"))) as gw:
        yield gw
