"""What one simulator app holds, and the key it is stored under in the aiohttp app."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from simulator.config import SimConfig
from simulator.dcgm import DcgmExporter
from simulator.engine import Engine
from simulator.errors import model_not_found
from simulator.journal import RequestJournal
from simulator.metrics import SimMetrics
from simulator.tokens import TextTokenizer


@dataclass(frozen=True)
class SimState:
    """The parts of one running simulator; ``created`` is its start time (Unix seconds).

    ``dcgm`` holds the GPU gauges, served only when ``config.dcgm`` is set.
    """

    config: SimConfig
    tokenizer: TextTokenizer | None
    metrics: SimMetrics
    journal: RequestJournal
    engine: Engine
    created: int
    dcgm: DcgmExporter

    def resolve_model(self, requested: str | None) -> str:
        """The model name to answer with; 404 ``SimError`` for a name not served.

        Without ``--models`` any name is served and echoed; a request without ``model`` gets the
        first served model (vLLM's behaviour), or the pool name when any model is accepted.
        """
        if requested is None:
            return self.config.served_name
        if self.config.models and requested not in self.config.models:
            raise model_not_found(requested)
        return requested

    def listed_models(self) -> tuple[str, ...]:
        """Names ``GET /v1/models`` lists: the served models, else the pool name."""
        return self.config.models or (self.config.name,)


STATE = web.AppKey("simulator_state", SimState)
