"""Envoy reads a stream's token usage for the rate limiter, so extproc need not read the body.

``sse_to_metadata`` (work in progress in Envoy 1.40) writes what the stream-done rate-limit call
settles with (see :mod:`routing.ratelimits`): ``llm_tokens``, the usage chunk's
``usage.total_tokens`` as a string (the rate-limit ``metadata`` action reads only strings),
written as the chunk passes (vLLM sends it when the request has
``stream_options.include_usage``), and ``llm_done``, written only at the stream's end (a deferred
action that an aborted or reset stream never reaches), so a stream cut after its usage chunk
settles nothing.

A stream whose client did not ask for usage gets ``stream_options.include_usage`` added by
extproc (metadata ``strip_usage``), and a Lua filter removes the usage chunk from what the client
receives. The Lua filter sits *before* ext_proc in the chain, so on the response it runs after
ext_proc, once ext_proc has let the response headers go to the client: its ``setBytes`` also
sets the response's ``content-length`` to the length of the chunk it rewrote (Envoy's
``BufferWrapper::luaSetBytes``, meant for whole buffered bodies), and while ext_proc still held
the headers for extproc's answer (a short stream under load) they left with that length (``0``
for an emptied last chunk) instead of chunked framing: the client read that many bytes, the rest
broke the next response on the keep-alive connection (``ClientResponseError``), and HTTP/2
clients refused the stream (docs/decisions/0006-lua-usage-strip.md; ``bench.lua_strip_repro``).
It reads events, not bytes (issue 35): an event whose data is a JSON object with an empty
top-level ``choices`` and an object ``usage`` is dropped, in whatever key order and spacing the
engine wrote it (llama.cpp's server puts ``choices`` first and ``created`` after it, so a byte
match on vLLM's ``"choices":[],"usage":{`` leaked it); a C-speed pattern picks the few events
holding a usage object before any is scanned in Lua (Envoy's CPU per stream as before:
``bench.lua_strip_repro --cpu-against``). It holds back only an event not yet ended
by its blank line (``\n\n`` or ``\r\n\r\n``), drops such a tail at the end of a stream, as
every SSE client does, and calls ``setBytes`` only on a chunk it changes. The SSE filter sits
after ext_proc, so it reads the pool's bytes; ext_proc
passes on unchanged the bodies it reads (a sampled or canary stream with ``strip_usage``), so
the Lua filter sees the pool's bytes too. Both
act on every route (Envoy decides a route's per-filter config before extproc's answer re-routes
the request): the Lua filter only where extproc set ``strip_usage``, the SSE filter only on
``text/event-stream`` answers, whose usage is the same whoever reads it. Not
``json_to_metadata``: it holds a whole JSON answer, and one above Envoy's buffer limit (an
embeddings batch, a chat answer with logprobs) would become a 500; it could not be turned off
for those routes. Verified with Envoy 1.40 in ``tests/e2e/test_envoy_usage.py`` and
``tests/e2e/test_usage_strip_order.py``.
"""

from __future__ import annotations

from typing import Any

from routing.render.clusters import API, TYPE
from sidecar_runtime.wire.names import (
    DONE_METADATA_KEY,
    METADATA_NAMESPACE,
    STRIP_USAGE_METADATA_KEY,
    TOKENS_METADATA_KEY,
)

SSE_FILTER = "envoy.filters.http.sse_to_metadata"
LUA_FILTER = "envoy.filters.http.lua"
_TOTAL = [{"key": "usage"}, {"key": "total_tokens"}]
_NEVER_PRESENT = [{"key": "llm_sidecar_end_of_stream"}]
"""A key no answer has: its rule's deferred on_missing / on_error runs only at end of stream."""


def _put(key: str, value: str | None = None) -> dict[str, Any]:
    pair: dict[str, Any] = {"metadata_namespace": METADATA_NAMESPACE, "key": key}
    if value is None:
        pair["type"] = "STRING"
    else:
        pair["value"] = value
    return pair


def sse_usage_filter() -> dict[str, Any]:
    done = _put(DONE_METADATA_KEY, "1")
    return {
        "name": SSE_FILTER,
        "typed_config": {
            TYPE: API + "extensions.filters.http.sse_to_metadata.v3.SseToMetadata",
            "response_rules": {"content_parser": {
                "name": "envoy.content_parsers.json",
                "typed_config": {
                    TYPE: API + "extensions.content_parsers.json.v3.JsonContentParser",
                    "rules": [
                        {"rule": {"selectors": _TOTAL, "on_present": _put(TOKENS_METADATA_KEY)}},
                        # [DONE] is not JSON (an error for the parser): both deferred actions.
                        {"rule": {"selectors": _NEVER_PRESENT, "on_missing": done,
                                  "on_error": done}},
                    ],
                },
            }},
        },
    }


STRIP_USAGE_LUA = f"""
-- Is this SSE event the usage event the gateway asked for? Read as an event, not matched as
-- bytes, so any engine's key order and spacing is understood: its data is a JSON object whose
-- top-level "choices" is an empty array and whose top-level "usage" is an object. A plain
-- search first: only an event holding a usage object (one a stream) is scanned in Lua.
local function has_usage_object(text)
  local from = 1
  while true do
    local _, e = string.find(text, '"usage"', from, true)
    if e == nil then return false end
    if string.find(text, "^%s*:%s*{{", e + 1) ~= nil then return true end
    from = e + 1
  end
end

local function is_usage(ev)
  if not has_usage_object(ev) then return false end
  local lines = {{}}
  for line in string.gmatch(ev, "[^\\r\\n]+") do
    local value = string.match(line, "^data:%s?(.*)$")
    if value ~= nil then lines[#lines + 1] = value end
  end
  local json = table.concat(lines, "\\n")
  local depth, i, n = 0, 1, #json
  local empty_choices, usage_object = false, false
  while i <= n do
    local c = string.byte(json, i)
    if c == 34 then
      local j = i + 1
      while true do
        local k = string.find(json, '["\\\\]', j)
        if k == nil then return false end
        if string.byte(json, k) == 92 then j = k + 2 else j = k; break end
      end
      if depth == 1 then
        local _, colon = string.find(json, "^%s*:%s*", j + 1)
        if colon ~= nil then
          local key = string.sub(json, i + 1, j - 1)
          if key == "choices" then
            empty_choices = string.find(json, "^%[%s*%]", colon + 1) ~= nil
          elseif key == "usage" then
            usage_object = string.byte(json, colon + 1) == 123
          end
        end
      end
      i = j + 1
    else
      if c == 123 or c == 91 then depth = depth + 1
      elseif c == 125 or c == 93 then depth = depth - 1 end
      i = i + 1
    end
  end
  return empty_choices and usage_object
end

-- Where the last whole event of ``data`` ends (its blank line: \\n\\n or \\r\\n\\r\\n), or nil.
local function last_event_end(data)
  local last, from = nil, 1
  while true do
    local _, e = string.find(data, "\\n\\n", from, true)
    if e == nil then break end
    last, from = e, e + 1
  end
  if string.find(data, "\\r", 1, true) ~= nil then
    from = 1
    while true do
      local _, e = string.find(data, "\\n\\r\\n", from, true)
      if e == nil then break end
      if last == nil or e > last then last = e end
      from = e + 1
    end
  end
  return last
end

-- ``events`` (whole events) without the usage one.
local function without_usage(events)
  local kept, from = {{}}, 1
  while true do
    local _, e = string.find(events, "\\r?\\n\\r?\\n", from)
    if e == nil then break end
    local ev = string.sub(events, from, e)
    if not is_usage(ev) then kept[#kept + 1] = ev end
    from = e + 1
  end
  return table.concat(kept)
end

function envoy_on_response(handle)
  local md = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if md == nil or md["{STRIP_USAGE_METADATA_KEY}"] ~= "1" then return end
  local ctype = handle:headers():get("content-type") or ""
  if string.find(ctype, "text/event-stream", 1, true) ~= 1 then return end
  local carry = ""
  for chunk in handle:bodyChunks() do
    local got = chunk:getBytes(0, chunk:length())
    local data = carry .. got
    -- Whole events pass (the usage one left out); the start of an event not yet ended waits
    -- for the next chunk. Only a chunk holding a usage object is read event by event.
    local last = last_event_end(data)
    local out = ""
    if last == nil then
      carry = data
    else
      out, carry = string.sub(data, 1, last), string.sub(data, last + 1)
      if has_usage_object(out) then out = without_usage(out) end
    end
    -- setBytes also rewrites the response's content-length: only on a chunk that changed.
    if out ~= got then chunk:setBytes(out) end
  end
end
"""


def strip_usage_filter() -> dict[str, Any]:
    return {"name": LUA_FILTER, "typed_config": {
        TYPE: API + "extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": STRIP_USAGE_LUA}}}


def usage_filters_before_ext_proc() -> list[dict[str, Any]]:
    """The Lua strip: before ext_proc in the chain, so after it on the response (its
    ``setBytes`` must not run while ext_proc holds the response headers)."""
    return [strip_usage_filter()]


def usage_filters_after_ext_proc() -> list[dict[str, Any]]:
    """The usage reader: after ext_proc (before the rate-limit filter and the router), so it
    reads the pool's bytes."""
    return [sse_usage_filter()]
