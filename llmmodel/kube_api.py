"""The few Kubernetes API calls the operator makes, behind a Protocol so the reconcile logic is
tested against an in-memory fake (no kube-apiserver runs on development or CI machines).

:class:`InClusterApi` is the real one: plain REST over ``aiohttp`` with the pod's service account.
It was written against the Kubernetes API conventions and has NOT been run against a real
cluster; the tests only exercise its path building and request shaping.

- Server-side apply is a ``PATCH`` with ``Content-Type: application/apply-patch+yaml`` (JSON is
  YAML), ``fieldManager`` and ``force=true``: the operator owns the fields it writes, even ones a
  person set by hand with ``kubectl edit``. Forcing is safe only on objects the LLMModel already
  controls, so reconcile reads each first and applies nothing over one it does not.
- Objects a model no longer declares are found by their model label (``labelSelector``) and
  deleted with ``propagationPolicy=Background``; only those the LLMModel controls (see
  :mod:`llmmodel.operator_prune`).
- Status goes through the ``/status`` subresource as a JSON merge patch, so keys other writers
  keep under ``.status`` survive.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

FIELD_MANAGER = "llm-sidecar"
LLMMODEL_API_VERSION = "llm-sidecar.dev/v1alpha1"
LLMMODEL_KIND = "LLMModel"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

PLURALS: Mapping[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("apps/v1", "Deployment"): "deployments",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    (LLMMODEL_API_VERSION, LLMMODEL_KIND): "llmmodels",
}
"""(apiVersion, kind) → the plural resource name in its REST path: the only kinds we touch."""


class KubeApiError(Exception):
    """A request the API server refused or could not answer (``status`` 0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"Kubernetes API: {status}: {message}" if status else
                         f"Kubernetes API: {message}")


class KubeApi(Protocol):
    """What reconcile needs from the cluster; every object is a plain dict as the API returns it."""

    async def apply(self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER) -> None:
        """Server-side apply of ``obj`` (its namespace is in ``metadata``), forcing conflicts."""

    async def get(self, api_version: str, kind: str, namespace: str,
                  name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""

    async def list_llmmodels(self, namespace: str) -> list[dict[str, Any]]:
        """Every LLMModel of ``namespace`` (those being deleted included)."""

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge ``status`` into the LLMModel's ``.status`` (the status subresource)."""

    async def list_labelled(self, api_version: str, kind: str, namespace: str,
                            selector: str) -> list[dict[str, Any]]:
        """The objects of ``kind`` in ``namespace`` matching the label ``selector`` (``k=v``)."""

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete the object (its dependents in the background); one already gone is no error."""


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """The REST path of a namespaced object (or of its collection when ``name`` is None)."""
    plural = PLURALS.get((api_version, kind))
    if plural is None:
        raise KubeApiError(0, f"the operator does not handle {kind} of {api_version}")
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{quote(namespace, safe='')}/{plural}"
    return path if name is None else f"{path}/{quote(name, safe='')}"


class InClusterApi:
    """:class:`KubeApi` from inside a pod: ``KUBERNETES_SERVICE_HOST``/``PORT``, the service
    account's CA and token. The token file is read on every request because the kubelet rotates
    projected tokens in place. ``base_url`` instead names another API endpoint, like the
    ``http://127.0.0.1:8001`` of ``kubectl proxy`` (no token file there: no ``Authorization``).
    Not run against a real cluster (see the module docstring)."""

    def __init__(self, *, base_url: str | None = None, account_dir: str = SERVICE_ACCOUNT_DIR,
                 timeout_s: float = 30.0) -> None:
        if base_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise KubeApiError(0, "KUBERNETES_SERVICE_HOST is not set: run the operator in "
                                      "a pod")
            base_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.base_url = base_url.rstrip("/")
        self._account_dir = account_dir
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _token(self) -> str | None:
        try:
            with open(os.path.join(self._account_dir, "token"), encoding="utf-8") as handle:
                return handle.read().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise KubeApiError(0, f"cannot read the service account token: {exc.strerror}") from None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            ca = os.path.join(self._account_dir, "ca.crt")
            context = ssl.create_default_context(cafile=ca if os.path.exists(ca) else None)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context), timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, *, body: dict[str, Any] | None = None,
                       content_type: str = "application/json",
                       params: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The decoded answer; None for 404; :class:`KubeApiError` for any other failure."""
        headers = {"Accept": "application/json"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            async with self._open().request(method, self.base_url + path, data=data,
                                            headers=headers, params=params) as response:
                text = await response.text()
                if response.status == 404:
                    return None
                if response.status >= 300:
                    raise KubeApiError(response.status, _message(text))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeApiError(0, f"{method} {path}: {str(exc) or type(exc).__name__}") from None
        try:
            decoded = json.loads(text) if text else {}
        except ValueError:
            raise KubeApiError(response.status, f"{method} {path}: not JSON: {text[:200]}") from None
        if not isinstance(decoded, dict):
            raise KubeApiError(response.status, f"{method} {path}: not an object: {text[:200]}")
        return decoded

    async def apply(self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER) -> None:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        await self._request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                            params={"fieldManager": field_manager, "force": "true"})

    async def get(self, api_version: str, kind: str, namespace: str,
                  name: str) -> dict[str, Any] | None:
        return await self._request("GET", resource_path(api_version, kind, namespace, name))

    async def list_llmmodels(self, namespace: str) -> list[dict[str, Any]]:
        answer = await self._request(
            "GET", resource_path(LLMMODEL_API_VERSION, LLMMODEL_KIND, namespace)) or {}
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = resource_path(LLMMODEL_API_VERSION, LLMMODEL_KIND, namespace, name) + "/status"
        await self._request("PATCH", path, body={"status": status},
                            content_type="application/merge-patch+json")

    async def list_labelled(self, api_version: str, kind: str, namespace: str,
                            selector: str) -> list[dict[str, Any]]:
        # a 404 here is a kind whose CRD is not installed: nothing of it exists
        answer = await self._request("GET", resource_path(api_version, kind, namespace),
                                     params={"labelSelector": selector}) or {}
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        # Background: the call returns at once and the garbage collector removes dependents
        # (a Deployment's ReplicaSets and pods) afterwards
        await self._request("DELETE", resource_path(api_version, kind, namespace, name),
                            params={"propagationPolicy": "Background"})


def _message(text: str) -> str:
    """The ``message`` of a Kubernetes ``Status`` answer, else the body's start."""
    try:
        status = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return str(status["message"])
    return text[:200]
