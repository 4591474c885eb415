"""The processor of a request no API kind takes: one fixed client error."""

from __future__ import annotations

from extproc.actions import Action, Reply
from extproc.context import RequestContext
from extproc.processors.base import BaseProcessor


class ErrorProcessor(BaseProcessor):
    """Answers every request with one fixed client error (unknown path, wrong method)."""

    def __init__(self, ctx: RequestContext, reply: Reply) -> None:
        super().__init__(ctx)
        self.reply = reply

    def on_request_headers(self, end_of_stream: bool) -> Action:
        return self.reply
