"""``envelope.iso`` formats the date and time of day once per second: its text must stay exactly
``datetime``'s (microseconds rounded half-even, then cut to milliseconds) on every kind of value."""

from __future__ import annotations

import random
from datetime import datetime, timezone

from proxy.envelope import iso


def datetime_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_iso_is_datetimes_text_on_edges_and_random_values():
    edges = [0.0, 1.0, 0.9995, 0.9999995, 0.0000005, 2.5e-6, 86399.9999999, 1e9 + 0.5e-6, 1e9 + 1.5e-6,
             1764561934.9999996, 1764561934.0000004, 1764561934.999, 4102444799.9999995]
    rng = random.Random(14)
    values = edges + [rng.randint(0, 4_000_000_000) + rng.randint(0, 999_999) / 1e6
                      + rng.choice((0.0, 5e-7, -5e-7, 4.9e-7)) for _ in range(20000)]
    for ts in values:
        assert iso(ts) == datetime_iso(ts), ts


def test_iso_of_consecutive_calls_across_a_second_boundary():
    # the one-second cache must not leak a previous second's text into the next
    for ts in (1764561934.998, 1764561935.001, 1764561934.5, 1764561999.0):
        assert iso(ts) == datetime_iso(ts)
