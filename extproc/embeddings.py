"""``/v1/embeddings``: routed by its longest input; the embedding cache plugs in here."""

from __future__ import annotations

from extproc.actions import PASS, Action, Continue
from extproc.bodies import parse_embeddings
from extproc.decide import decide, parse_context_hint
from extproc.processors import BaseProcessor, body_required, resolve_model, route_headers
from extproc.tokens import counter_for


class EmbeddingsProcessor(BaseProcessor):
    """``/v1/embeddings``: routed by its longest input (the cache comes in a later step)."""

    def on_request_headers(self, end_of_stream: bool) -> Action:
        return body_required() if end_of_stream else PASS

    def on_request_body(self, body: bytes) -> Action:
        parsed = parse_embeddings(body)
        model = resolve_model(self.ctx, parsed.model, "embedding")
        counter = counter_for(model.tokenizer)
        longest = max(
            counter.count(item) if isinstance(item, str) else len(item) for item in parsed.inputs
        )
        hint = parse_context_hint(self.ctx.headers.get("x-context-length"))
        decision = decide(model, longest, 0, hint, self.ctx.identity.key_id,
                          self.ctx.snapshot.high_below, self.ctx.snapshot.low_from)
        return Continue(set_headers=route_headers(self.ctx, model, decision),
                        clear_route_cache=True)
