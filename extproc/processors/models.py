"""The model list processor: ``GET /v1/models`` answered from the config."""

from __future__ import annotations

import orjson

from extproc.actions import Action, Reply
from extproc.processors.base import BaseProcessor


class ModelsProcessor(BaseProcessor):
    """``GET /v1/models``: the gateway answers with the models it routes."""

    def on_request_headers(self, end_of_stream: bool) -> Action:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llm-sidecar",
             "max_model_len": model.max_context}
            for name, model in self.ctx.snapshot.models.items()
        ]
        return Reply(200, orjson.dumps({"object": "list", "data": data}))
