"""Read Prometheus's text exposition format, and estimate quantiles from histogram buckets.

Pure functions, no I/O: ``parse_samples`` turns what a Prometheus endpoint serves (the
classic text format 0.0.4, as the OpenTelemetry Collector's Prometheus exporter writes it, or
OpenMetrics text) into samples; ``histogram_quantile`` estimates a quantile from cumulative
buckets as PromQL's function of that name does. ``nemo-gym-otel report`` reads the collector
with them. The plugin's runtime dependencies stay the design's five, so this is not
``prometheus_client``'s parser; it reads only what a sample line can hold:

    name{label="value",...} value [timestamp] [# {exemplar labels} value [timestamp]]

Comment lines (``# HELP``, ``# TYPE``, ``# UNIT``, ``# EOF``) and blank lines carry no sample.
A line that is not a sample raises ``ValueError`` naming its line number and text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One sample line: its metric name, labels, value and (where given) timestamp in ms."""

    name: str
    labels: Mapping[str, str]
    value: float
    timestamp_ms: float | None = None


def parse_samples(text: str) -> list[Sample]:
    """Every sample of ``text``, in order. Raises ``ValueError`` on a malformed line."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            samples.append(_sample(stripped))
        except ValueError as error:
            raise ValueError(f"line {number}: {error}: {line[:200]!r}") from None
    return samples


def _sample(line: str) -> Sample:
    name_match = _NAME.match(line)
    if name_match is None:
        raise ValueError("no metric name")
    name = name_match.group()
    position = name_match.end()
    labels: dict[str, str] = {}
    if position < len(line) and line[position] == "{":
        labels, position = _labels(line, position + 1)
    rest = line[position:]
    if not rest[:1].isspace():
        raise ValueError("no space before the value")
    # An OpenMetrics exemplar follows " # "; label values cannot hold it unescaped here,
    # since the labels have been read already.
    fields = rest.split(" # ", 1)[0].split()
    if len(fields) not in (1, 2):
        raise ValueError("expected a value and at most a timestamp")
    value = _float(fields[0], "value")
    timestamp = _float(fields[1], "timestamp") if len(fields) == 2 else None
    return Sample(name, labels, value, timestamp)


def _labels(line: str, position: int) -> tuple[dict[str, str], int]:
    """The labels from ``position`` (just after ``{``) and the position after their ``}``."""
    labels: dict[str, str] = {}
    while True:
        while position < len(line) and line[position] in " \t":
            position += 1
        if position < len(line) and line[position] == "}":
            return labels, position + 1
        label_match = _LABEL_NAME.match(line, position)
        if label_match is None:
            raise ValueError(f"bad label name at column {position + 1}")
        position = label_match.end()
        if line[position : position + 2] != '="':
            raise ValueError(f'expected =" after label {label_match.group()!r}')
        value, position = _label_value(line, position + 2)
        labels[label_match.group()] = value
        if position < len(line) and line[position] == ",":
            position += 1
        elif position >= len(line) or line[position] != "}":
            raise ValueError(f"expected , or }} after label {label_match.group()!r}")


def _label_value(line: str, position: int) -> tuple[str, int]:
    """The quoted value from ``position`` (just after its opening quote), unescaped, and the
    position after its closing quote."""
    characters: list[str] = []
    while position < len(line):
        character = line[position]
        if character == '"':
            return "".join(characters), position + 1
        if character == "\\":
            escaped = line[position + 1 : position + 2]
            if escaped not in _ESCAPES:
                raise ValueError(f"bad escape \\{escaped} in a label value")
            characters.append(_ESCAPES[escaped])
            position += 2
            continue
        characters.append(character)
        position += 1
    raise ValueError("unterminated label value")


def _float(text: str, what: str) -> float:
    try:
        return float(text)  # float() reads +Inf, -Inf and NaN as Prometheus writes them
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None


def histogram_quantile(quantile: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``quantile`` (0 to 1) of a histogram given as ``(upper bound, cumulative count)``
    pairs (``le`` buckets, ``+Inf`` among them), as PromQL's ``histogram_quantile`` estimates
    it: linear within the bucket the rank falls in, the lowest bucket starting at 0, and the
    highest finite bound where the rank falls in the ``+Inf`` bucket. ``None`` without
    observations."""
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile {quantile} is not between 0 and 1")
    ordered = sorted(buckets)
    if not ordered or not math.isinf(ordered[-1][0]) or ordered[-1][1] <= 0:
        return None
    rank = quantile * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in ordered:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if count == lower_count:
                return upper_bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (upper_bound - lower_bound) * share
        lower_bound, lower_count = upper_bound, count
    return lower_bound
