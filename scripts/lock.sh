#!/usr/bin/env bash
# Refresh requirements.lock: the exact versions, with hashes, of pyproject.toml's dependencies plus its
# [test] extra and the build backend of the editable install (setuptools), for the CPython 3.11 on Linux
# the suite runs on. scripts/setup.sh installs exactly this file (pip --require-hashes), then the project
# itself with --no-deps.
#
#   scripts/lock.sh                       add what pyproject.toml gained, drop what it lost; every other
#                                         pin stays as it is (pip-compile keeps the existing file's pins)
#   scripts/lock.sh --upgrade             move every pin to the newest version the ranges allow
#   scripts/lock.sh --upgrade-package X   move only X (repeatable; X==1.2.3 pins it)
#
# Run it after changing dependencies in pyproject.toml, commit requirements.lock with that change, then
# run scripts/setup.sh and the tests: the lock records what the suite passed with.
# pip-compile (pip-tools, pinned below) is installed into .venv on first use.
set -euo pipefail

PIP_TOOLS_VERSION="7.6.2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VBIN="$ROOT/.venv/bin"
LOCK="requirements.lock"

log() { printf 'lock: %s\n' "$*" >&2; }

[[ -x "$VBIN/python" ]] || { log "no .venv: run scripts/setup.sh first"; exit 1; }
if [[ "$("$VBIN/pip-compile" --version 2>/dev/null | awk '{print $NF}')" != "$PIP_TOOLS_VERSION" ]]; then
    log "installing pip-tools $PIP_TOOLS_VERSION into .venv"
    "$VBIN/python" -m pip install -q --disable-pip-version-check "pip-tools==$PIP_TOOLS_VERSION"
fi

cd "$ROOT"
# The options are recorded in the file's header; keep them in step with scripts/setup.sh's install.
"$VBIN/pip-compile" --quiet --generate-hashes --allow-unsafe --extra test --build-deps-for editable \
    --strip-extras --no-emit-find-links --annotation-style line --output-file "$LOCK" "$@" pyproject.toml
log "$LOCK: $(grep -c '^[A-Za-z0-9]' "$LOCK") packages pinned with hashes; now run scripts/setup.sh and the tests"
