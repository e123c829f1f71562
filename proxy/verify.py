"""Verify stage: the backend's result must match the tool's ``outputSchema``.

Owns: checking output shape and turning a mismatch into ``output_invalid``
(the raw output is withheld). Must never: repair, coerce or forward output
that failed, or treat output text as instructions to the proxy.
"""

from __future__ import annotations

from typing import Any

from .decode import schema_violations
from .errors import ProxyError
from .registry import ToolContract


def verify_output(tool: ToolContract, data: Any) -> Any:
    violations = schema_violations(data, tool.output_validator)
    if violations:
        # Paths and keywords only: messages could quote the untrusted output.
        raise ProxyError(
            "output_invalid",
            "The tool returned data that does not conform to its output schema.",
            details={"tool": tool.name,
                     "violations": [{"path": v["path"], "keyword": v["keyword"]} for v in violations[:20]]},
            phase="verify", attempted=True,
            # A 2xx from a write backend is evidence the effect happened even if
            # its answer is unusable; a retry must not run it again.
            committed=True if tool.is_write else False)
    return data
