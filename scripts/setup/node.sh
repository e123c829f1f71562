# shellcheck shell=bash
# Node tools for the MCP interop tests, pinned by tests/node/package-lock.json: Node 22 (npm's `node` package:
# the conformance suite needs >= 22, the system Node may be older), @modelcontextprotocol/conformance, sdk,
# inspector, the older inspector-cli and server-everything, installed with `npm ci` (exactly the lock, or
# nothing) into .tools/node/ and linked as tests/node/node_modules for the test scripts.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

NODE_DIR="$ROOT/.tools/node"
install_node_tools() {
    command -v npm >/dev/null 2>&1 || die "npm not found: install Node.js (>= 18) and npm; the MCP interop tests need them"
    local want have
    want="$(sha256_of "$ROOT/tests/node/package-lock.json")"
    have="$(cat "$NODE_DIR/.lock.sha256" 2>/dev/null || true)"
    if [[ "$want" != "$have" || ! -x "$NODE_DIR/node_modules/.bin/node" ]]; then
        log "installing pinned Node tools into .tools/node (npm ci with tests/node/package-lock.json)"
        mkdir -p "$NODE_DIR"
        cp "$ROOT/tests/node/package.json" "$ROOT/tests/node/package-lock.json" "$NODE_DIR/"
        if ! (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error); then
            # vite names an optional Windows-only dependency, napi-windows-process-start-time, that npm
            # mirrors have served on some days and not on others, and `npm ci` refuses a lock that differs
            # from what it resolves. Then `npm install` with the same lock; the check below still refuses
            # any installed version the lock does not pin.
            log "WARNING: npm ci refused the lock; installing with npm install and checking every version"
            cp "$ROOT/tests/node/package-lock.json" "$NODE_DIR/"
            (cd "$NODE_DIR" && npm install --no-audit --no-fund --loglevel=error)
        fi
        # Every package both locks name has the committed version; a package only one of them names is an
        # optional one for another platform (what the mirror served that day), never one installed here.
        "$VENV/bin/python" - "$ROOT/tests/node/package-lock.json" "$NODE_DIR/package-lock.json" <<'PY' \
            || die "npm resolved other versions than tests/node/package-lock.json pins: the lock is out of date"
import json, sys
pinned, resolved = (json.load(open(path))["packages"] for path in sys.argv[1:3])
drift = [path for path in pinned.keys() | resolved.keys()
         if (path in pinned and path in resolved and pinned[path].get("version") != resolved[path].get("version"))
         or ((path in pinned) != (path in resolved) and not (pinned.get(path) or resolved.get(path)).get("optional"))]
for path in sorted(drift)[:10]:
    print(f"setup: {path}: pinned {pinned.get(path, {}).get('version')}, resolved {resolved.get(path, {}).get('version')}",
          file=sys.stderr)
sys.exit(1 if drift else 0)
PY
        printf '%s\n' "$want" > "$NODE_DIR/.lock.sha256"
    fi
    ln -sfn "$NODE_DIR/node_modules" "$ROOT/tests/node/node_modules"
}

summary_node() {
    printf 'node         %s  (%s)\n' "$NODE_DIR/node_modules/.bin/node" "$("$NODE_DIR/node_modules/.bin/node" --version)"
}
