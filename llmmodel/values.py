"""The values an LLMModel's fields hold, parsed and checked: sizes (``40Gi``), parameter counts
(``13B``), percentages, latencies, model names and ``modelPath`` forms. Each parser raises
``ValueError`` with the message a user sees (pydantic puts it at the field's ``FILE:LINE``)."""

from __future__ import annotations

import math
import re
from urllib.parse import unquote

from routing.units import parse_duration

_DNS_LABEL = re.compile(r"[a-z]([a-z0-9-]{0,40}[a-z0-9])?")
"""A model name: it names Services, which are DNS-1035 labels (a letter first)."""
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_HF_SEGMENT = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_LOCAL_PATH = re.compile(r"[^\s:]+")
MAX_BYTES = 1 << 50
"""The largest size accepted (1 PiB): far above any GPU's memory, and small enough for a float."""
MAX_COUNT = 10**15
"""The largest parameter count accepted (a quadrillion)."""
_BYTES = re.compile(r"^(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|KB|MB|GB|TB)?$")
_BYTE_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
               "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMBT])?$")
_COUNT_UNITS = {None: 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_bytes(text: str | int) -> int:
    """``40Gi`` (binary), ``40G`` or ``40GB`` (decimal), or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > MAX_BYTES:
            raise ValueError(f"{shortened(text)} is too large: at most 1Pi")
        return text
    else:
        match = _BYTES.fullmatch(str(text).strip())
        if not match:
            raise ValueError(f"{shortened(text)} is not a size: write it like 40Gi (or 40G, 40GB)")
        value: float = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{shortened(text)} is too large: at most 1Pi")
    return int(value)


def parse_count(text: str | int) -> int:
    """``13B``, ``7.2B``, ``560M`` or a plain number (a parameter count)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > MAX_COUNT:
            raise ValueError(f"{shortened(text)} is too large: at most 1000T (10^15)")
        return text
    else:
        match = _COUNT.fullmatch(str(text).strip().upper())
        if not match:
            raise ValueError(f"{shortened(text)} is not a count: write it like 13B or 560M")
        value: float = float(match.group(1)) * _COUNT_UNITS[match.group(2)]
    if not math.isfinite(value) or value > MAX_COUNT:
        raise ValueError(f"{shortened(text)} is too large: at most 1000T (10^15)")
    return int(value)


def shortened(text: str | int) -> str:
    """``text`` for a message, a 400-digit number cut short."""
    shown = repr(text) if isinstance(text, str) else str(text)
    return shown if len(shown) <= 40 else f"{shown[:20]}...{shown[-10:]} ({len(shown)} characters)"


def parse_percent(text: str | float) -> float:
    """``99.95%`` or ``99.95`` as the fraction 0.9995."""
    try:
        value = float(str(text).strip().removesuffix("%")) if not isinstance(text, float) else text
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage: write it like 99.9%") from None
    if not 0 < value < 100:
        raise ValueError(f"{text!r}: an availability is above 0% and below 100%, like 99.9%")
    if value < 50:
        # 0.999 is a fraction written where a percentage goes: it would mean 0.999%.
        raise ValueError(f"{text!r} would mean {value:g}%: write the availability as a percentage "
                         "like 99.9%")
    return value / 100


def parse_latency(text: str) -> float:
    """``200ms``, ``1.5s`` or ``2m`` in seconds."""
    raw = str(text).strip()
    if raw.endswith("ms"):
        try:
            return float(raw[:-2]) / 1000
        except ValueError:
            raise ValueError(f"{text!r} is not a duration: write it like 200ms or 1.5s") from None
    try:
        return float(raw.removesuffix("s")) if raw.endswith("s") else float(parse_duration(raw))
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: write it like 200ms or 1.5s") from None


def check_model_name(value: str) -> None:
    """Raises ``ValueError`` unless ``value`` can name a model's pools and Kubernetes objects."""
    if not _DNS_LABEL.fullmatch(value):
        raise ValueError(f"{value!r}: a model name is lower-case letters, digits and '-', starting "
                         "with a letter, at most 42 characters (it names pools and Kubernetes "
                         "Services)")


_PATH_FORMS = "give s3://BUCKET/KEY, gs://BUCKET/KEY, hf://ORG/NAME, pvc://CLAIM/PATH or a local path"


def check_model_path(value: str) -> None:
    """Raises ``ValueError`` unless ``value`` is a ``modelPath`` of a known form. A ``..``
    segment is refused in every form (it would leave the volume, bucket prefix or directory a
    reader expects the weights under)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if scheme not in ("", "hf", "pvc", "s3", "gs"):
        raise ValueError(f"{value!r}: {_PATH_FORMS}")
    segments = rest.replace("\\", "/").split("/")
    if any(unquote(segment).strip() == ".." for segment in segments):
        raise ValueError(f"{value!r}: a modelPath has no '..' segment")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError(f"{value!r}: a modelPath has no spaces or control characters")
    if scheme == "hf":
        if len(segments) != 2 or not all(_HF_SEGMENT.fullmatch(s) for s in segments):
            raise ValueError(f"{value!r}: write a Hugging Face model as hf://ORG/NAME (letters, digits, "
                             "'.', '_' and '-', not starting with '-')")
    elif scheme == "pvc":
        claim = segments[0]
        if not claim or len(claim) > 253 or not _DNS_SUBDOMAIN.fullmatch(claim):
            raise ValueError(f"{value!r}: write pvc://CLAIM/PATH with CLAIM a PersistentVolumeClaim's "
                             "name (lower-case letters, digits, '-' and '.')")
    elif scheme in ("s3", "gs"):
        if not _BUCKET.fullmatch(segments[0]):
            raise ValueError(f"{value!r}: write {scheme}://BUCKET/KEY with BUCKET a bucket name "
                             "(lower-case letters, digits, '.', '_' and '-')")
    elif scheme or not _LOCAL_PATH.fullmatch(value):
        raise ValueError(f"{value!r}: {_PATH_FORMS}")
