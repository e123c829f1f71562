#!/usr/bin/env bash
# Start the local dev stack (`toolproxy dev`) after making sure the
# environment is set up. Arguments are passed to `toolproxy dev`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
exec "$ROOT/.venv/bin/toolproxy" dev "$@"
