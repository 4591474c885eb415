from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.actions import Continue, ModeOverride, Phase, Reply, evolve
from extproc.adapters import ext_proc_pb
from sidecar_runtime.wire.names import (
    DESTINATION_ENDPOINT,
    LB_METADATA_NAMESPACE,
    METADATA_NAMESPACE,
    RESERVATION_METADATA_KEY,
)


def headers_request(**headers: str) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    for key, value in headers.items():
        h = request.request_headers.headers.headers.add()
        h.key = key.replace("_", "-")
        h.raw_value = value.encode()
    request.request_headers.end_of_stream = True
    return request


def test_read_headers_from_raw_value_and_join_repeats() -> None:
    request = headers_request(x_a="1")
    extra = request.request_headers.headers.headers.add()
    extra.key, extra.value = "X-A", "2"
    phase, headers, body, end = ext_proc_pb.read(request)
    assert (phase, headers, body, end) == ("request_headers", {"x-a": "1,2"}, b"", True)


def test_read_body() -> None:
    request = pb.ProcessingRequest()
    request.request_body.body = b"{}"
    request.request_body.end_of_stream = True
    assert ext_proc_pb.read(request) == ("request_body", None, b"{}", True)


def test_request_trailers_are_read_and_answered() -> None:
    request = pb.ProcessingRequest()
    trailer = request.request_trailers.trailers.headers.add()
    trailer.key, trailer.raw_value = "x-llm-cluster", b"vllm-long"
    assert ext_proc_pb.read(request) == ("request_trailers", None, b"", True)
    response = ext_proc_pb.build("request_trailers", Continue())
    assert response.WhichOneof("response") == "request_trailers"
    assert not response.request_trailers.HasField("header_mutation")
    reply = ext_proc_pb.build("request_trailers", Reply(400, b"{}"))
    assert reply.immediate_response.status.code == 400


def test_a_mode_override_keeps_request_trailers_sent() -> None:
    response = ext_proc_pb.build("request_headers", Continue(mode=ModeOverride()))
    assert response.mode_override.request_trailer_mode == 1  # SEND


def test_empty_continue_still_names_the_phase() -> None:
    response = ext_proc_pb.build("request_headers", Continue())
    assert response.WhichOneof("response") == "request_headers"


def test_continue_with_mutations() -> None:
    action = Continue(set_headers=(("x-llm-cluster", "a"),), remove_headers=("x-llm-tenant",),
                      body=b"new", clear_route_cache=True,
                      mode=ModeOverride(response_headers=True, response_body="buffered"),
                      metadata={"tokens": 5})
    response = ext_proc_pb.build("request_body", action)
    common = response.request_body.response
    assert common.header_mutation.set_headers[0].header.raw_value == b"a"
    assert list(common.header_mutation.remove_headers) == ["x-llm-tenant"]
    assert common.body_mutation.body == b"new" and common.clear_route_cache
    assert response.mode_override.response_body_mode == 2  # BUFFERED
    assert response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value \
        .fields["tokens"].number_value == 5


def test_reply_is_an_immediate_response() -> None:
    response = ext_proc_pb.build("request_body", Reply(413, b'{"error": {}}', details="x"))
    immediate = response.immediate_response
    assert immediate.status.code == 413 and immediate.body == b'{"error": {}}'
    assert immediate.headers.set_headers[0].header.key == "content-type"


def test_an_empty_body_replacement_clears_the_chunk() -> None:
    held = ext_proc_pb.build("response_body", Continue(body=b"")).response_body.response.body_mutation
    assert held.WhichOneof("mutation") == "clear_body" and held.clear_body
    replaced = ext_proc_pb.build("response_body", Continue(body=b"{}")).response_body.response
    assert replaced.body_mutation.body == b"{}"
    untouched = ext_proc_pb.build("response_body", Continue()).response_body.response
    assert not untouched.HasField("body_mutation")


def test_the_reservation_rides_on_the_request_body_answer() -> None:
    """The rate-limit filter reads it from the ``llm_sidecar`` namespace at admission."""
    action = Continue(set_headers=(("x-llm-cluster", "a"),), clear_route_cache=True,
                      metadata={RESERVATION_METADATA_KEY: 2_000_000_123})
    response = ext_proc_pb.build("request_body", action)
    assert response.WhichOneof("response") == "request_body"
    assert response.request_body.response.clear_route_cache
    namespace = response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
    assert list(namespace.fields) == [RESERVATION_METADATA_KEY] == ["llm_reservation"]
    assert namespace.fields[RESERVATION_METADATA_KEY].number_value == 2_000_000_123
    assert not ext_proc_pb.build("request_body", Continue()).HasField("dynamic_metadata")



def test_lb_endpoints_go_out_as_the_endpoint_picker_protocol_says() -> None:
    """``envoy.lb``/``x-gateway-destination-endpoint``: primary then fallbacks, comma-joined,
    beside the ``llm_sidecar`` namespace, and the same value as a request header that
    replaces any copy (never appended to one)."""
    action = Continue(set_headers=(("x-llm-cluster", "pool"),), clear_route_cache=True,
                      metadata={RESERVATION_METADATA_KEY: 7},
                      lb_endpoints=("10.0.0.5:8000", "10.0.0.6:8000"))
    for phase in ("request_headers", "request_body"):
        response = ext_proc_pb.build(phase, action)
        fields = response.dynamic_metadata.fields
        assert sorted(fields) == [LB_METADATA_NAMESPACE, METADATA_NAMESPACE] == \
            ["envoy.lb", "llm_sidecar"]
        lb = fields[LB_METADATA_NAMESPACE].struct_value.fields
        assert {k: v.string_value for k, v in lb.items()} == {
            "x-gateway-destination-endpoint": "10.0.0.5:8000,10.0.0.6:8000"}
        reservation = fields[METADATA_NAMESPACE].struct_value.fields[RESERVATION_METADATA_KEY]
        assert reservation.number_value == 7
        common = getattr(response, phase).response
        headers = {h.header.key: (h.header.raw_value, h.append_action)
                   for h in common.header_mutation.set_headers}
        overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        assert headers == {
            "x-llm-cluster": (b"pool", overwrite),
            "x-gateway-destination-endpoint": (b"10.0.0.5:8000,10.0.0.6:8000", overwrite)}


def test_one_endpoint_alone_each_once_and_none_sends_nothing() -> None:
    response = ext_proc_pb.build("request_body", Continue(lb_endpoints=("10.0.0.5:8000",)))
    lb = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    assert lb[DESTINATION_ENDPOINT].string_value == "10.0.0.5:8000"
    repeated = ext_proc_pb.build("request_headers", Continue(lb_endpoints=("a:1", "b:1", "a:1", "c:1")))
    lb = repeated.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    assert lb[DESTINATION_ENDPOINT].string_value == "a:1,b:1,c:1"  # Envoy would retry a repeat
    plain = ext_proc_pb.build("request_body", Continue(set_headers=(("x-llm-cluster", "a"),)))
    assert not plain.HasField("dynamic_metadata")
    assert [h.header.key for h in plain.request_body.response.header_mutation.set_headers] == \
        ["x-llm-cluster"]


@pytest.mark.parametrize("phase", ["response_headers", "response_body"])
def test_lb_endpoints_on_a_response_phase_are_refused(phase: Phase) -> None:
    """A response header would hand the client the pods' addresses; it is a bug, said loudly."""
    with pytest.raises(ValueError, match="request phase"):
        ext_proc_pb.build(phase, Continue(lb_endpoints=("10.0.0.5:8000",)))


# --- the header mutation is written as bytes: the same answer upb's API built ----------------

def upb_built(phase: Phase, action: Continue | Reply) -> bytes:
    """The answer as ext_proc_pb.build wrote it before it wrote header options as bytes: each option
    added through upb's API."""
    response = pb.ProcessingResponse()
    remove: tuple[str, ...] = ()
    if isinstance(action, Reply):
        target = response.immediate_response.headers
        response.immediate_response.status.code = action.status
        response.immediate_response.body = action.body
        if action.details:
            response.immediate_response.details = action.details
        pairs = action.headers
    else:
        getattr(response, phase).SetInParent()
        target = getattr(response, phase).response.header_mutation
        pairs, remove = action.set_headers, action.remove_headers
    for key, value in pairs:
        option = target.set_headers.add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    if remove:
        target.remove_headers.extend(remove)
    raw: bytes = response.SerializeToString()
    return raw


MUTATIONS: dict[str, Continue | Reply] = {
    "routing headers": Continue(set_headers=(("x-llm-cluster", "vllm-short"),
                                             ("x-llm-model", "llama-2-13b"),
                                             ("x-llm-context-length", "124")),
                                remove_headers=("authorization", "x-api-key")),
    "non-ASCII value": Continue(set_headers=(("x-llm-tenant", "café-日本"),)),
    "value of 128 bytes and more": Continue(set_headers=(("x-a", "v" * 128), ("x-b", "w" * 20_000))),
    "empty value": Continue(set_headers=(("x-empty", ""),)),
    "empty name": Continue(set_headers=(("", "v"),), remove_headers=("",)),
    "the same header twice": Continue(set_headers=(("x-a", "1"), ("x-a", "1"))),
    "only removals": Continue(remove_headers=("x-llm-cluster", "x-llm-model")),
    "many headers": Continue(set_headers=tuple((f"x-h{i}", f"v{i}") for i in range(2000))),
    "immediate response": Reply(429, b'{"error": {}}', headers=(
        ("content-type", "application/json"), ("retry-after", "1")), details="limited"),
    "immediate response, no headers": Reply(400, b"{}", headers=()),
}


@pytest.mark.parametrize("action", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_header_mutations_are_the_bytes_upbs_api_built(action: Continue | Reply) -> None:
    for _ in range(2):  # the second time from the cache of encoded options
        built = ext_proc_pb.build("request_body", action)
        assert built.SerializeToString() == upb_built("request_body", action)
        assert built == pb.ProcessingResponse.FromString(upb_built("request_body", action))


def test_no_headers_leave_no_mutation() -> None:
    assert not ext_proc_pb.build("request_body", Continue(body=b"x")).request_body.response \
        .HasField("header_mutation")
    assert not ext_proc_pb.build("request_body", Reply(400, b"{}", headers=())).immediate_response \
        .HasField("headers")


@pytest.mark.parametrize("mode", [ModeOverride(headers, body) for headers in (True, False)
                                  for body in ("none", "streamed", "buffered")])
def test_every_mode_is_the_same_each_time(mode: ModeOverride) -> None:
    first = ext_proc_pb.build("request_headers", Continue(mode=mode)).SerializeToString()
    again = ext_proc_pb.build("request_headers", Continue(mode=ModeOverride(mode.response_headers,
                                                                     mode.response_body)))
    assert again.SerializeToString() == first
    assert again.mode_override.response_header_mode == (1 if mode.response_headers else 2)
    assert again.mode_override.response_body_mode == {"none": 0, "streamed": 1,
                                                      "buffered": 2}[mode.response_body]


# --- dynamic metadata is set field by field: the same answer Struct.update built -------------

METADATA: dict[str, dict[str, object]] = {
    "a routed request's": {"llm_reservation": 124, "llm_lease": "67fb7b79cc0050f52b0af389",
                           "cluster": "vllm-short"},
    "usage": {"llm_tokens": "60", "llm_done": "1"},
    "numbers": {"zero": 0, "negative": -7, "big": 2**53 + 1, "past a double": 2**70,
                "float": 0.25, "inf": float("inf")},
    "bool, None, empty": {"yes": True, "no": False, "none": None, "empty": "", "é日": "ü"},
    "nested and lists": {"inner": {"a": 1, "b": {"c": "d"}}, "list": [1, "two", None, {"x": 3}]},
    "mixed order": {"z": "1", "a": True, "m": 2, "b": None, "y": "y"},
}


def struct_updated(phase: Phase, action: Continue) -> bytes:
    """The answer as ext_proc_pb.build wrote it before it set metadata field by field: one
    ``Struct.update`` of both namespaces."""
    response = pb.ProcessingResponse()
    getattr(response, phase).SetInParent()
    metadata: dict[str, object] = {}
    if action.metadata:
        metadata[METADATA_NAMESPACE] = dict(action.metadata)
    if action.lb_endpoints:
        metadata[LB_METADATA_NAMESPACE] = {DESTINATION_ENDPOINT: ",".join(action.lb_endpoints)}
        response.request_body.response.header_mutation.MergeFrom(
            ext_proc_pb.build(phase, evolve(action, metadata={})).request_body.response.header_mutation)
    response.dynamic_metadata.update(metadata)
    raw: bytes = response.SerializeToString()
    return raw


@pytest.mark.parametrize("metadata", METADATA.values(), ids=METADATA.keys())
@pytest.mark.parametrize("endpoints", [(), ("10.0.0.5:8000", "10.0.0.6:8000")])
def test_metadata_is_the_bytes_struct_update_built(metadata: dict[str, object],
                                                   endpoints: tuple[str, ...]) -> None:
    action = Continue(metadata=metadata, lb_endpoints=endpoints)
    built = ext_proc_pb.build("request_body", action)
    assert built.SerializeToString() == struct_updated("request_body", action)
    assert built == pb.ProcessingResponse.FromString(struct_updated("request_body", action))


PHASES: tuple[Phase, ...] = ("request_headers", "request_body", "request_trailers",
                             "response_headers", "response_body")
PLAIN = [None] + [ModeOverride(headers, body) for headers in (True, False)
                  for body in ("none", "streamed", "buffered")]


@pytest.mark.parametrize("phase", PHASES)
def test_answers_that_only_continue_are_the_ones_built_each_time(phase: Phase) -> None:
    """Parsed from the bytes kept for their phase and mode: the answer built afresh, and a
    fresh message each time (a change to one answer reaches no other)."""
    for mode in PLAIN:
        for _ in range(2):
            action = Continue(mode=mode)
            answer = ext_proc_pb.build(phase, action)
            assert answer.SerializeToString() == ext_proc_pb._build(phase, action).SerializeToString()
            assert answer is not ext_proc_pb.build(phase, action)
    if phase == "request_trailers":
        return  # its answer holds nothing more
    # Anything more than a mode is built, not taken from what was kept.
    for action in (Continue(body=b""), Continue(clear_route_cache=True),
                   Continue(metadata={"a": "1"}), Continue(set_headers=(("x-a", "1"),)),
                   Continue(remove_headers=("x-a",))):
        assert ext_proc_pb.build(phase, action) != ext_proc_pb.build(phase, Continue())
