"""gpu_agent.metrics.text held to prometheus_client: the same families render to the same bytes as its
generate_latest writes them, and a whole simulated node's /metrics is what prometheus_client made of it."""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from test_metrics_fields import built

from gpu_agent.metrics import text
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.sampler import Sampler

VALUES = [0, 1, -1, 0.5, 3, 2.25, 1e-05, 123456, 1234567, 1700000000.123, 1e16, 1.5e21, 1e300, -1e300, 5e-324,
          -0.0, 2**53 + 1, -(2**40), math.inf, -math.inf, math.nan, True, False]
TEXTS = ["", "a", "nvidia.com/gpu", 'quote " in', "back\\slash", "new\nline", "ünïcødé ✓", "{braces}", "a,b=c"]


class Families:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        return iter(self.families)


def theirs(families: list[text.Family]) -> bytes:
    converted = []
    for family in families:
        kind = CounterMetricFamily if family.kind == text.COUNTER else GaugeMetricFamily
        made = kind(family.name, family.help, labels=list(family.labels))
        for values, value in family.samples:
            made.add_metric(list(values), value)
        converted.append(made)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(converted))  # type: ignore[arg-type]
    return generate_latest(registry)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_are_formatted_as_prometheus_client_formats_them(value: float) -> None:
    assert text.go_float(value) == floatToGoString(value)


def test_random_families_render_byte_for_byte_as_prometheus_client_renders_them() -> None:
    rng = random.Random(15)
    names = ["gpu", "UUID", "stage", "a_b", "Hostname", "zeta", "_x"]
    for _ in range(300):
        families = []
        for number in range(rng.randrange(1, 5)):
            labels = rng.sample(names, rng.randrange(len(names)))
            make = rng.choice([text.gauge, text.counter])
            family = make(f"gpu_agent_m{number}", rng.choice(TEXTS) + " help", labels=labels)
            for _ in range(rng.randrange(4)):
                family.add([rng.choice(TEXTS) for _ in labels], rng.choice(VALUES))
            families.append(family)
        assert text.render(families).encode() == theirs(families)


def test_an_unlabelled_family_with_its_value() -> None:
    family = text.counter("gpu_agent_reconciles", "Reconcile passes run.", value=3)
    assert family.text() == ("# HELP gpu_agent_reconciles_total Reconcile passes run.\n"
                             "# TYPE gpu_agent_reconciles_total counter\ngpu_agent_reconciles_total 3.0\n")
    assert family.text().encode() == theirs([family])


def test_a_sample_with_the_wrong_number_of_label_values_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_agent_x: 1 label values for the labels"):
        text.gauge("gpu_agent_x", "x", labels=["a", "b"]).add(["1"], 1)


def test_a_simulated_node_renders_as_prometheus_client_rendered_it(tmp_path: Path) -> None:
    runtime = built(tmp_path, "dgx-h100")
    try:
        sampler = Sampler(runtime.nvml, runtime.state, runtime.root)
        sampler.sample()
        sampler.sample()
    finally:
        runtime.nvml.close()
    registry = make_registry(AgentCollector(runtime.state, lambda: 2, "node-1"))
    own = list(registry.families())
    assert {"gpu_agent_reconciles", "gpu_agent_stage_ok", "gpu_agent_gpu_healthy",
            "process_resident_memory_bytes"} <= {family.name for family in own}
    assert text.render(own).encode() == theirs(own)
    scraped = render(registry).decode()  # the same families, then the DCGM series as dcgm-exporter writes them
    parsed = {family.name: family for family in text_string_to_metric_families(scraped)}
    assert {"gpu_agent_reconciles", "gpu_agent_stage_ok", "process_resident_memory_bytes",
            "DCGM_FI_DEV_GPU_TEMP"} <= set(parsed)
    assert len(parsed["gpu_agent_gpu_healthy"].samples) == 8
