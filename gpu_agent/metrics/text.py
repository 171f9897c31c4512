"""The Prometheus text exposition format, version 0.0.4 (prometheus.io/docs/instrumenting/exposition_formats),
written here rather than by prometheus_client, whose package imports an HTTP server, WSGI, urllib and email
with it (1.8 MiB resident in the daemon, 30 ms). A family renders as prometheus_client's generate_latest
renders the same CounterMetricFamily or GaugeMetricFamily, byte for byte (tests/test_metrics_text.py holds
it to that): HELP and TYPE, a counter's samples named NAME_total, labels sorted by name, values as Go
formats floats."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GAUGE = "gauge"
COUNTER = "counter"


class Family:
    """One metric family: its samples in the order added."""

    __slots__ = ("name", "help", "kind", "labels", "samples")

    def __init__(self, name: str, help: str, kind: str, labels: Sequence[str] = (),
                 value: Optional[float] = None) -> None:
        self.name = name
        self.help = help
        self.kind = kind
        self.labels = tuple(labels)
        self.samples: list[tuple[tuple[str, ...], float]] = []
        if value is not None:
            self.add((), value)

    def add(self, values: Sequence[str], value: float) -> None:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(values)} label values for the labels {self.labels}")
        self.samples.append((tuple(values), value))

    def text(self) -> str:
        name = self.name + "_total" if self.kind == COUNTER else self.name
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        out = [f"# HELP {name} {help_text}\n# TYPE {name} {self.kind}\n"]
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        names = tuple(self.labels[i] for i in order)
        for values, value in self.samples:
            out.append(sample(name, names, [values[i] for i in order], value))
        return "".join(out)


def gauge(name: str, help: str, labels: Sequence[str] = (), value: Optional[float] = None) -> Family:
    return Family(name, help, GAUGE, labels, value)


def counter(name: str, help: str, labels: Sequence[str] = (), value: Optional[float] = None) -> Family:
    return Family(name, help, COUNTER, labels, value)


def sample(name: str, labels: Sequence[str], values: Sequence[str], value: float) -> str:
    """One sample line, its labels in the order given."""
    if not labels:
        return f"{name} {go_float(value)}\n"
    pairs = ",".join(f'{key}="{escape(text)}"' for key, text in zip(labels, values))
    return f"{name}{{{pairs}}} {go_float(value)}\n"


def escape(value: str) -> str:
    """A label value: backslash, newline and double quote escaped."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def go_float(value: float) -> str:
    """A value as prometheus_client's floatToGoString writes it: Python's repr (3.0, 1e-05, NaN, +Inf), with
    a positive value of seven or more integer digits in the exponent form Go would use (1700000000.0 is
    1.7e+09)."""
    number = float(value)
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    if math.isnan(number):
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def render(families: Iterable[Family]) -> str:
    return "".join(family.text() for family in families)
