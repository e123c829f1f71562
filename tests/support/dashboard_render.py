"""Draw a dashboard's panel set from its JSON and two live /metrics scrapes (no Grafana here).

``evaluate(expr, before, after, seconds)`` computes the instant value of the
PromQL subset the dashboards use — selectors with matchers, ``rate`` and
``increase`` (the difference between the two scrapes; ``rate`` divides by the
seconds between them), ``sum``/``min``/``max``/``avg`` with ``by``,
``histogram_quantile`` (Prometheus's linear interpolation within a bucket),
``clamp_min`` and ``/`` — and raises ``Unsupported`` for anything else, so a
dashboard query this cannot draw fails the test instead of showing nothing.
``page(board, values)`` lays the panels out on Grafana's 24-column grid as
HTML with one bar per series (its legend, its value), for a screenshot.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Mapping

from prometheus_client.parser import text_string_to_metric_families

from tests.support.promql import tokens

Labels = frozenset  # of (name, value)
Vector = dict  # Labels -> float


class Unsupported(ValueError):
    pass


def series(text: str) -> dict[tuple[str, Labels], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


class _Evaluator:
    def __init__(self, expr: str, before: Mapping, after: Mapping, seconds: float) -> None:
        self.toks = tokens(expr)
        self.pos = 0
        self.before, self.after, self.seconds = before, after, seconds

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.toks[i][1] if i < len(self.toks) else ""

    def take(self, expected: str | None = None) -> str:
        text = self.peek()
        if expected is not None and text != expected:
            raise Unsupported(f"expected {expected!r}, found {text!r}")
        self.pos += 1
        return text

    def run(self) -> Any:
        value = self.expr()
        if self.pos != len(self.toks):
            raise Unsupported(f"unexpected {self.peek()!r}")
        return value

    def expr(self) -> Any:
        left = self.term()
        while self.peek() == "/":
            self.take()
            right = self.term()
            left = _divide(left, right)
        return left

    def term(self) -> Any:
        kind, text = self.toks[self.pos]
        if kind == "number":
            self.take()
            return float(text)
        if text == "(":
            self.take()
            value = self.expr()
            self.take(")")
            return value
        if text in ("sum", "min", "max", "avg"):
            return self.aggregation()
        if self.peek(1) == "(":
            return self.function()
        if kind == "ident":
            return self.selector()
        raise Unsupported(f"cannot evaluate {text!r}")

    def aggregation(self) -> Vector:
        op = self.take()
        by: tuple[str, ...] = ()
        if self.peek() == "by":
            self.take()
            by = self.label_list()
        self.take("(")
        vector = self.expr()
        self.take(")")
        groups: dict[Labels, list[float]] = {}
        for labels, value in vector.items():
            key = frozenset((k, v) for k, v in labels if k in by)
            groups.setdefault(key, []).append(value)
        reduce = {"sum": sum, "min": min, "max": max, "avg": lambda v: sum(v) / len(v)}[op]
        return {k: reduce(v) for k, v in groups.items()}

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(names)

    def function(self) -> Any:
        name = self.take()
        self.take("(")
        if name in ("rate", "increase"):
            metric, matchers, window = self.selector_parts()
            self.take(")")
            if window is None:
                raise Unsupported(f"{name} needs a range")
            out = {}
            for (sname, labels), value in self.after.items():
                if sname == metric and _matches(labels, matchers):
                    delta = value - self.before.get((sname, labels), 0.0)
                    out[frozenset((k, v) for k, v in labels)] = delta / self.seconds if name == "rate" else delta
            return out
        if name == "histogram_quantile":
            q = float(self.take())
            self.take(",")
            vector = self.expr()
            self.take(")")
            return _quantile(q, vector)
        if name == "clamp_min":
            vector = self.expr()
            self.take(",")
            floor = float(self.take())
            self.take(")")
            return {k: max(v, floor) for k, v in vector.items()}
        raise Unsupported(f"function {name} is not drawn")

    def selector_parts(self) -> tuple[str, list[tuple[str, str, str]], str | None]:
        metric = self.take()
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), self.take()
                matchers.append((label, op, value[1:-1]))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        window = self.take() if self.peek().startswith("[") else None
        return metric, matchers, window

    def selector(self) -> Vector:
        metric, matchers, window = self.selector_parts()
        if window is not None:
            raise Unsupported("a range vector outside rate/increase")
        return {labels: value for (name, labels), value in self.after.items()
                if name == metric and _matches(labels, matchers)}


def _matches(labels: Labels, matchers: list[tuple[str, str, str]]) -> bool:
    values = dict(labels)
    for label, op, wanted in matchers:
        have = values.get(label, "")
        ok = {"=": have == wanted, "!=": have != wanted, "=~": re.fullmatch(wanted, have) is not None,
              "!~": re.fullmatch(wanted, have) is None}[op]
        if not ok:
            return False
    return True


def _divide(left: Any, right: Any) -> Any:
    if isinstance(left, dict) and isinstance(right, dict):
        return {k: (v / right[k] if right[k] else math.nan) for k, v in left.items() if k in right}
    raise Unsupported("only vector / vector is drawn")


def _quantile(q: float, vector: Vector) -> Vector:
    """Prometheus's histogram_quantile: find the bucket holding rank q*count, interpolate linearly in it."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, value in vector.items():
        le = dict(labels).get("le")
        if le is None:
            continue
        key = frozenset((k, v) for k, v in labels if k != "le")
        groups.setdefault(key, []).append((float(le), value))
    out = {}
    for key, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0:
            continue  # no observations in the window: Prometheus returns NaN, Grafana draws nothing
        rank = q * total
        lower, below = 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    out[key] = lower
                else:
                    out[key] = lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 0)
                break
            lower, below = upper, count
    return out


def evaluate(expr: str, before: Mapping, after: Mapping, seconds: float) -> Any:
    return _Evaluator(expr, before, after, seconds).run()


def legend(template: str, labels: Labels) -> str:
    values = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), template) or "value"


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.1f} %"
    if unit == "s":
        return f"{value * 1000:.2f} ms" if value < 1 else f"{value:.2f} s"
    suffix = {"reqps": " req/s", "ops": " /s"}.get(unit, "")
    return f"{value:.3g}{suffix}"


def page(board: Mapping[str, Any], values: Mapping[tuple[int, str], Any], note: str) -> str:
    """HTML for the whole panel set: ``values[(panel id, refId)]`` is the evaluated vector."""
    boxes = []
    for panel in board["panels"]:
        grid = panel["gridPos"]
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        rows = []
        for target in panel["targets"]:
            vector = values[(panel["id"], target["refId"])]
            rows += [(legend(target["legendFormat"], labels), value) for labels, value in sorted(vector.items(),
                     key=lambda item: sorted(item[0]))]
        finite = [abs(v) for _, v in rows if not math.isnan(v)]
        top = max(finite) if finite and max(finite) > 0 else 1.0
        bars = "".join(
            f'<div class="row"><span class="name">{html.escape(name)}</span>'
            f'<span class="bar" style="width:{0 if math.isnan(v) else 100 * abs(v) / top:.1f}%"></span>'
            f'<span class="val">{html.escape(_fmt(v, unit))}</span></div>' for name, v in rows) \
            or '<div class="none">no data in this window</div>'
        boxes.append(f'<div class="panel" style="grid-column:{grid["x"] + 1} / span {grid["w"]};'
                     f'grid-row:{grid["y"] + 1} / span {grid["h"]}"><h2>{html.escape(panel["title"])}</h2>'
                     f'<div class="kind">{html.escape(panel["type"])}</div>{bars}</div>')
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ margin: 0; background: #111217; color: #ccccdc; font: 13px system-ui, sans-serif; }}
header {{ padding: 10px 16px; }} header h1 {{ font-size: 18px; margin: 0; color: #fff; }}
header p {{ margin: 4px 0 0; color: #8e8e9e; font-size: 12px; }}
.grid {{ display: grid; grid-template-columns: repeat(24, 1fr); grid-auto-rows: 30px; gap: 8px; padding: 8px 16px; }}
.panel {{ background: #181b1f; border: 1px solid #2c3235; border-radius: 3px; padding: 6px 10px; overflow: hidden; }}
.panel h2 {{ font-size: 13px; margin: 0 0 2px; color: #fff; font-weight: 500; }}
.kind {{ font-size: 10px; color: #6e6e7e; margin-bottom: 6px; }}
.row {{ display: grid; grid-template-columns: minmax(8em, 40%) 1fr auto; align-items: center; gap: 8px; margin: 3px 0; }}
.name {{ white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
.bar {{ height: 10px; background: #73bf69; border-radius: 2px; min-width: 1px; }}
.val {{ font-variant-numeric: tabular-nums; color: #fff; }}
.none {{ color: #6e6e7e; }}
</style></head><body><header><h1>{html.escape(board["title"])}</h1><p>{html.escape(note)}</p></header>
<div class="grid">{"".join(boxes)}</div></body></html>"""
