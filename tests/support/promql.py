"""A small PromQL checker: tokenizes an expression, checks its brackets, names and
durations, and returns the metric names it selects.

It is not a full parser (``promtool check rules`` is, and tests/test_alert_rules.py
runs it when the binary is installed); it catches what breaks rule files in
practice: unbalanced brackets, misspelt functions, bad durations, stray
characters, and metric names that the proxy does not export.
"""

from __future__ import annotations

import re

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "delta", "deriv", "exp", "floor", "histogram_quantile",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln",
    "log2", "log10", "max_over_time", "min_over_time", "minute", "month", "predict_linear", "present_over_time",
    "quantile_over_time", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                      "and", "or", "unless", "atan2"})

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<duration>\[(?:\d+(?:ms|[smhdwy]))+(?::(?:\d+(?:ms|[smhdwy]))*)?\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=,(){}])
""", re.VERBOSE)


class PromQLError(ValueError):
    pass


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise PromQLError(f"unexpected character {expr[pos]!r} at {pos}")
        kind = match.lastgroup or ""
        if kind != "ws":
            out.append((kind, match.group()))
        pos = match.end()
    return out


def metric_names(expr: str) -> set[str]:
    """Check ``expr`` and return the metric names it selects."""
    toks = tokens(expr)
    stack: list[str] = []
    pairs = {")": "(", "}": "{"}
    names: set[str] = set()
    in_braces = False
    for i, (kind, text) in enumerate(toks):
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        prev = toks[i - 1][1] if i else ""
        if text in ("(", "{"):
            stack.append(text)
            in_braces = text == "{"
        elif text in pairs:
            if not stack or stack.pop() != pairs[text]:
                raise PromQLError(f"unbalanced {text!r} in {expr!r}")
            in_braces = False
        if kind != "ident" or in_braces:
            continue
        if nxt == "(":
            if text not in FUNCTIONS | AGGREGATIONS | KEYWORDS:
                raise PromQLError(f"unknown function {text!r}")
            continue
        if text in KEYWORDS or text in AGGREGATIONS:
            continue
        if prev in ("(", ",") and _inside_grouping(toks, i):
            continue  # a label name in by (...) / on (...)
        names.add(text)
    if stack:
        raise PromQLError(f"unclosed {stack[-1]!r} in {expr!r}")
    return names


def _inside_grouping(toks: list[tuple[str, str]], i: int) -> bool:
    """True if token ``i`` sits in the parentheses of by/without/on/ignoring/group_*."""
    depth = 0
    for j in range(i - 1, -1, -1):
        text = toks[j][1]
        if text == ")":
            depth += 1
        elif text == "(":
            if depth == 0:
                return j > 0 and toks[j - 1][1] in {"by", "without", "on", "ignoring", "group_left", "group_right"}
            depth -= 1
    return False


def label_names(expr: str) -> set[str]:
    """The label names ``expr`` relies on: in ``{name op value}`` matchers and in by/without/on/ignoring/
    group_* clauses (checked with ``metric_names`` first)."""
    metric_names(expr)
    toks = tokens(expr)
    names: set[str] = set()
    in_braces = False
    for i, (kind, text) in enumerate(toks):
        if text in ("{", "}"):
            in_braces = text == "{"
            continue
        if kind != "ident":
            continue
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if in_braces and nxt in ("=", "!=", "=~", "!~"):
            names.add(text)
        elif not in_braces and toks[i - 1][1] in ("(", ",") and _inside_grouping(toks, i):
            names.add(text)
    return names
