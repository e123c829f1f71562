"""Write the proxy's config schema (``toolproxy config-reference --json-schema``) into the Helm chart's
values.schema.json as ``definitions.proxyConfig``, which ``proxy.config`` refers to: the chart then refuses at
render what ``toolproxy run`` would refuse (``identity.mode: jwtt``, ``idenity:``, ``audit.sinks: [stdot]``).

    .venv/bin/python scripts/chart_config_schema.py          # rewrite the definition in place
    .venv/bin/python scripts/chart_config_schema.py --check  # exit 1 when it differs from the typed config

Only that definition's text changes (the rest of the file keeps its hand-written layout).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.config import json_schema  # noqa: E402

SCHEMA = REPO / "deploy" / "helm" / "toolproxy" / "values.schema.json"
KEY = '"proxyConfig": '


def rendered(text: str) -> str:
    block = json.dumps(json_schema(), indent=2).replace("\n", "\n    ")
    if KEY in text:
        start = text.index(KEY) + len(KEY)
        _, length = json.JSONDecoder().raw_decode(text[start:])
        return text[:start] + block + text[start + length:]
    anchor = '  "definitions": {\n'
    return text.replace(anchor, anchor + "    " + KEY + block + ",\n", 1)


def main() -> int:
    text = SCHEMA.read_text(encoding="utf-8")
    wanted = rendered(text)
    if "--check" in sys.argv[1:]:
        if wanted != text:
            print(f"{SCHEMA.relative_to(REPO)}: definitions.proxyConfig is not the typed config's schema: "
                  f"run .venv/bin/python scripts/chart_config_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
