"""JSON Schema validators whose common verdict — valid — comes from a compiled validator.

Owns: ``validator(schema, formats=...)``, a Draft 2020-12 validator with the
``jsonschema`` API the stages use (``is_valid``, ``iter_errors``, ``schema``), and
``check_schema(schema)``, jsonschema's check of a schema against the 2020-12
metaschema with the compiled verdict first (the registry checks every contract's
two schemas at start-up: in ``jsonschema`` alone that was most of a start-up's
registry time).
When the schema only uses keywords that ``jsonschema-rs`` (Rust) and
``jsonschema`` decide alike, an instance the compiled validator accepts is
valid without walking it in Python again; anything it refuses, or cannot take,
goes to ``jsonschema``, which stays the authority for every refusal and for its
report (paths, keywords, messages: the error envelopes do not change). Why: the
three validations of a call (request body, arguments, output) were about a
tenth of a read's CPU (docs/performance.md).

Must never: accept what ``jsonschema`` would refuse. So the fast path is off for
a schema using anything outside the keywords below (``$id`` only at its root), bounds or
enum/const numbers of 2**53 or more, ``format`` when formats are
asserted, ``multipleOf`` (float arithmetic differs), ``$ref`` outside the schema,
and a ``pattern`` using regex syntax the two engines read differently (Python's
``re`` against Rust's: ``\\w``, ``\\s``, ``\\b``, ``\\D``, flags, class set
operations, POSIX classes); ``tests/test_schema_fast.py`` holds the verdicts together.
"""

from __future__ import annotations

import re
from functools import cache, partial
from typing import Any, Callable, Iterator

import jsonschema_rs
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

# Keywords both implementations evaluate the same way (annotations included).
_SAME = frozenset({
    "$schema", "$defs", "$ref", "$comment", "$anchor", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties", "maxProperties", "allOf", "anyOf",
    "oneOf", "not", "patternProperties", "dependentRequired", "propertyNames", "if", "then", "else",
    "contains", "minContains", "maxContains",
})
_NAMED = frozenset({"properties", "patternProperties", "$defs"})  # name -> subschema
# Numbers both compare exactly: below 2**53 a float and an integer compare the same in Python and in an
# engine that turns one into the other (beyond it, 2**53 + 1 and 2.0**53 would be "equal").
_EXACT = 2 ** 53
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# Regex syntax read alike by Python's re and Rust's regex: literals, classes of literals/ranges, groups,
# alternation, quantifiers, anchors, and these escapes.
_SAFE_ESCAPES = frozenset("d.-/\\+*?()[]{}^$|ntr")
_UNSAFE_REGEX = re.compile(r"\[:|&&|--|~~|\(\?(?!:)")
# Every ``format`` the 2020-12 metaschema (its vocabularies) uses (tests/unit/test_schema_fast.py reads them).
META_FORMATS = frozenset({"regex", "uri", "uri-reference"})


def validator(schema: Any, *, formats: bool = False) -> "FastValidator":
    return FastValidator(schema, formats=formats)


def check_schema(schema: Any) -> None:
    """``Draft202012Validator.check_schema(schema)``: raises jsonschema's ``SchemaError`` (its message) exactly
    when it would. A schema the compiled meta-validator accepts is valid; anything else is jsonschema's to
    decide and report."""
    try:
        if _meta_validator().is_valid(schema):
            return
    except Exception:  # a value it cannot take (a YAML date, a set): jsonschema decides
        pass
    Draft202012Validator.check_schema(schema)


@cache
def _meta_validator() -> Any:
    """The 2020-12 metaschema, compiled, with each ``format`` it uses (``regex``, ``uri``, ``uri-reference``)
    decided by jsonschema's own format checker, as ``check_schema`` does: a ``pattern`` must compile in
    Python's ``re`` (not in Rust's regex), and a format jsonschema cannot check here is not asserted."""
    checker = Draft202012Validator.FORMAT_CHECKER
    return jsonschema_rs.Draft202012Validator(
        Draft202012Validator.META_SCHEMA, validate_formats=True,
        formats={name: partial(_conforms, checker, name) for name in META_FORMATS})


def _conforms(checker: Any, name: str, instance: Any) -> bool:
    return bool(checker.conforms(instance, name))



class FastValidator:
    def __init__(self, schema: Any, *, formats: bool) -> None:
        checker = Draft202012Validator.FORMAT_CHECKER if formats else None
        self.exact = Draft202012Validator(schema, format_checker=checker)
        self.schema = schema
        self._compiled = None
        # A root $id only names the document its local references resolve in (one elsewhere moves that base).
        if _alike({k: v for k, v in schema.items() if k != "$id"} if isinstance(schema, dict) else schema, formats):
            try:
                self._compiled = jsonschema_rs.Draft202012Validator(schema, validate_formats=False, offline=True)
            except Exception:  # a schema it cannot compile: jsonschema alone, as before
                self._compiled = None

    @property
    def fast(self) -> bool:
        return self._compiled is not None

    def surely_valid(self, instance: Any) -> bool:
        """The compiled verdict alone: True only when valid for certain; False says nothing."""
        return self._surely_valid(instance)

    def _surely_valid(self, instance: Any) -> bool:
        if self._compiled is None:
            return False
        try:
            return bool(self._compiled.is_valid(instance))
        except Exception:  # a value it cannot take (e.g. a type JSON has no name for): ask jsonschema
            return False

    def is_valid(self, instance: Any) -> bool:
        return self._surely_valid(instance) or self.exact.is_valid(instance)

    def iter_errors(self, instance: Any) -> Iterator[ValidationError]:
        if self._surely_valid(instance):
            return iter(())
        return self.exact.iter_errors(instance)


def _alike(node: Any, formats: bool) -> bool:
    """Whether both validators give the same verdict for every instance under this schema node."""
    if isinstance(node, bool):
        return True
    if not isinstance(node, dict):
        return False
    return all(_keyword_alike(key, value, formats) for key, value in node.items())


_SUBSCHEMA = ("additionalProperties", "items", "not", "propertyNames", "if", "then", "else", "contains")


_ONE_KEYWORD: dict[str, Callable[[Any, bool], bool]] = {  # keywords with a check of their own value
    "format": lambda value, formats: not formats,
    "enum": lambda value, formats: _exact_numbers(value),
    "const": lambda value, formats: _exact_numbers([value]),
    "$ref": lambda value, formats: isinstance(value, str) and value.startswith("#"),
    "pattern": lambda value, formats: _regex_alike(value),
}


def _keyword_alike(key: str, value: Any, formats: bool) -> bool:
    """One keyword of a schema node: its own check, or by the family it belongs to."""
    if key.startswith("x-"):
        return True  # extension annotations: both ignore them
    check = _ONE_KEYWORD.get(key)
    if check is not None:
        return check(value, formats)
    if key not in _SAME:
        return False
    if key in _BOUNDS:
        return type(value) in (int, float) and abs(value) < _EXACT
    if key in _NAMED:
        return _named_alike(key, value, formats)
    if key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        return isinstance(value, list) and all(_alike(sub, formats) for sub in value)
    if key in _SUBSCHEMA:
        return _alike(value, formats)
    return True  # annotations and data (default, examples, required, dependentRequired): nothing to compare


def _named_alike(key: str, value: Any, formats: bool) -> bool:
    if not isinstance(value, dict):
        return False
    if key == "patternProperties" and not all(_regex_alike(p) for p in value):
        return False
    return all(_alike(sub, formats) for sub in value.values())


def _exact_numbers(values: Any) -> bool:
    """Every number inside these enum/const values compares exactly (see ``_EXACT``)."""
    if isinstance(values, (list, tuple)):
        return all(_exact_numbers(v) for v in values)
    if isinstance(values, dict):
        return all(_exact_numbers(v) for v in values.values())
    return not isinstance(values, (int, float)) or isinstance(values, bool) or abs(values) < _EXACT


def _regex_alike(pattern: Any) -> bool:
    if not isinstance(pattern, str) or not pattern.isascii() or _UNSAFE_REGEX.search(pattern):
        return False
    escaped = False
    for char in pattern:
        if escaped:
            if char not in _SAFE_ESCAPES:
                return False
            escaped = False
        elif char == "\\":
            escaped = True
    return not escaped
