"""A bad field of an LLMModel is one ``FILE:LINE: message`` at the line of that field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmmodel.spec import load_models
from routing.errors import ConfigError
from tests.llmmodel.fixtures.models import line_of, write_model

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, spec keys, key whose line the error names, words the message holds)
    ("gpuRequest in words", {"gpuRequest": "forty"}, "gpuRequest", "is not a size"),
    ("gpuRequest below 1Gi", {"gpuRequest": "512Mi"}, "gpuRequest", "at least 1Gi"),
    ("availability 100%", {"sla": {"p99Latency": "200ms", "availability": "100%"}}, "sla",
     "below 100%"),
    ("latency in words", {"sla": {"p99Latency": "fast"}}, "sla", "is not a duration"),
    ("unknown quantization", {"quantization": "q3_k_s"}, "quantization", "quantization"),
    ("unknown key", {"gpuClas": "L4"}, "gpuClas", "unknown key 'gpuClas'"),
    ("bad model path", {"modelPath": "ftp://x y"}, "modelPath", "give s3://"),
    ("context too short", {"contexts": [64]}, "contexts", "from 128"),
    ("context twice", {"contexts": [2048, 2048]}, "contexts", "listed twice"),
    ("kv heads not dividing", {"architecture": {"parameters": "7B", "layers": 32, "hidden_size": 4096,
                                                "attention_heads": 32, "kv_heads": 5,
                                                "max_position": 4096}},
     "architecture", "multiple of kv_heads"),
]


@pytest.mark.parametrize(("spec", "key", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_field_is_one_file_line_error(tmp_path: Path, spec: dict[str, Any], key: str,
                                          words: str) -> None:
    path = write_model(tmp_path, **spec)
    with pytest.raises(ConfigError) as caught:
        load_models([str(path)])
    assert len(caught.value.problems) == 1, str(caught.value)
    problem = caught.value.problems[0]
    assert (problem.file, problem.line) == (str(path), line_of(path, key)), str(caught.value)
    assert words in problem.message


def test_good_model_loads_with_defaults(tmp_path: Path) -> None:
    model = load_models([str(write_model(tmp_path, base="llama-2-13b"))])[0]
    assert model.spec.quantization == "fp16"
    assert model.spec.gpu_request_bytes == 40 << 30
    assert model.spec.sla.p99_latency_s == pytest.approx(0.2)
    assert model.spec.sla.availability_fraction == pytest.approx(0.9995)
