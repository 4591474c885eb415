"""``llm-sidecar render --watch``: render again each time the routing YAML changes.

Beside Envoy in the gateway pod, with ``envoy.dynamic_pools``: Envoy reads the pools from the
``xds/`` files it watches, so a pool added to the mounted ConfigMap (by hand, or by the
LLMModel operator) reaches Envoy without a restart, as the same change reaches extproc and
ratelimit by their own reload. A file that does not load is reported and the last good render
stays; a change beyond the pools (services, listener, ``rate_limits:``) is rendered and reported
as needing an Envoy restart, since Envoy reads its bootstrap once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Hashable

from routing.errors import ConfigError
from routing.loader import load_config
from routing.render import write_all
from routing.render.envoy import bootstrap_fingerprint
from sidecar_runtime.process.reload import path_signature

POLL_S = 1.0
"""How often the file is looked at: a kubelet ConfigMap update takes a minute or so anyway."""


def _say(text: str) -> None:
    print(f"llm-sidecar render: {text}", file=sys.stderr, flush=True)


class RenderWatch:
    """The rendered state of one routing YAML: :meth:`check` renders again when it changed."""

    def __init__(self, config_path: str, out_dir: str, fingerprint: str, signature: Hashable,
                 say: Callable[[str], None] = _say) -> None:
        self.config_path = config_path
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        """The bootstrap Envoy was started with (it reads it once)."""
        self._say = say
        self._signature = signature
        """The file as it was when last read (``path_signature``)."""

    def check(self) -> bool:
        """Render again if the file changed since the last look; whether it rendered."""
        signature = path_signature(self.config_path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            config = load_config(self.config_path)
        except (ConfigError, OSError) as err:
            for line in str(err).splitlines():
                self._say(line)
            self._say("not rendered; Envoy keeps the last good files")
            return False
        try:
            write_all(config, self.out_dir)
        except Exception as err:  # a full disk, a folder gone, a render bug: keep watching
            self._say(f"cannot write {self.out_dir}: {err!r}; Envoy keeps the files it has")
            return False
        if bootstrap_fingerprint(config) != self.fingerprint:
            self._say("the change is beyond the pools (services, listener, limits or "
                      "envoy.dynamic_pools): envoy.yaml is rendered, restart Envoy to apply it")
        elif config.envoy.dynamic_pools:
            self._say("rendered; Envoy applies the pools from xds/ now")
        else:
            self._say("rendered; without envoy.dynamic_pools, restart Envoy to apply clusters")
        return True


def watch(config_path: str, out_dir: str, fingerprint: str, signature: Hashable,
          stop: threading.Event | None = None, interval_s: float = POLL_S) -> int:
    """After the first render (of the file whose ``path_signature`` was ``signature``, with the
    bootstrap ``fingerprint``), poll until SIGINT or SIGTERM (or ``stop``); exit 0."""
    done = stop or threading.Event()
    if stop is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
    state = RenderWatch(config_path, out_dir, fingerprint, signature)
    while not done.wait(interval_s):
        state.check()
    return 0
