"""Scrape a running proxy's ``/metrics`` and compare counters before and after a scenario."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, frozenset[tuple[str, str]]]


async def scrape_text(stack: Any) -> str:
    async with stack.session.get(stack.ops_url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return await response.text()


def samples(text: str) -> dict[Sample, float]:
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def exported_names(text: str) -> set[str]:
    """Every series name a query may use: counters as ``_total``, histograms as ``_bucket/_sum/_count``.

    Families without children yet (labelled metrics nobody recorded into) still
    count: their HELP/TYPE lines are in the exposition.
    """
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        kind = family.type
        if kind == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif kind == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def counter(values: dict[Sample, float], name: str, **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def counter_deltas(before: dict[Sample, float], after: dict[Sample, float]) -> dict[Sample, float]:
    """Changed ``*_total`` and histogram ``*_count`` samples (what a scenario incremented)."""
    deltas = {}
    for key, value in after.items():
        name = key[0]
        if not (name.endswith("_total") or name.endswith("_count")):
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            deltas[key] = delta
    return deltas


def sample(name: str, **labels: str) -> Sample:
    return (name, frozenset(labels.items()))
