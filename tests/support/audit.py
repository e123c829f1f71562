"""Audit records in test output: find them, validate them against schemas/audit-record.schema.json.

The stdout sink writes one JSON line per record; pytest captures stdout, and
the hook in tests/conftest.py validates every record each test produced.
Tests that read stdout themselves (``capsys``) call ``audit_records`` directly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from jsonschema import Draft202012Validator

from proxy.audit import RECORD_TYPE

REPO = Path(__file__).resolve().parent.parent.parent
VALIDATOR = Draft202012Validator(json.loads((REPO / "schemas" / "audit-record.schema.json").read_text()),
                                 format_checker=Draft202012Validator.FORMAT_CHECKER)


def violations(text: str) -> tuple[int, list[str]]:
    """(number of audit lines found, problems) for a chunk of captured output."""
    found, problems = 0, []
    for line in text.splitlines():
        if RECORD_TYPE not in line:
            continue
        found += 1
        try:
            record = json.loads(line)
        except ValueError as exc:
            problems.append(f"not JSON ({exc}): {line[:200]}")
            continue
        for error in VALIDATOR.iter_errors(record):
            problems.append(f"{list(error.absolute_path)}: {error.message} in {line[:300]}")
    return found, problems


def audit_records(text: str | Iterable[str]) -> list[dict[str, Any]]:
    """Every audit record in ``text`` (lines), each asserted valid against the schema."""
    if not isinstance(text, str):
        text = "\n".join(text)
    _, problems = violations(text)
    assert not problems, "audit records violate schemas/audit-record.schema.json:\n" + "\n".join(problems)
    return [json.loads(line) for line in text.splitlines() if RECORD_TYPE in line]


def fingerprinted(value: Any) -> bool:
    """Whether a record holds ``value`` as a keyed fingerprint (proxy/telemetry/record_view.py), not in clear."""
    return isinstance(value, str) and re.fullmatch(r"hmac:[0-9a-f]{16}", value) is not None
