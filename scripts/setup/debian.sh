# shellcheck shell=bash
# Debian packages the tests and benches drive: chromium (the console's browser tests), nftables (the egress
# guard's namespace test) and wrk (bench/floor.py's load generator). Each is optional: without apt-get (root or
# passwordless sudo) setup says which tests skip and goes on.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

# chromium: the console's browser tests drive it with Playwright for Python; Debian's package, never
# `playwright install`.
install_chromium() {
    [[ -x /usr/bin/chromium ]] && return 0
    if can_apt; then
        log "installing chromium with apt-get (browser tests of the operator console)"
        apt_get install -y --no-install-recommends chromium \
            || log "WARNING: apt-get install chromium failed; the console's browser tests will skip"
    else
        log "chromium: no apt-get; the console's browser tests will skip"
    fi
}

# nft (Debian's nftables): the egress guard's walk-around test applies the rules of `toolproxy egress-rules`
# in a fresh network namespace (tests/walkaround/test_egress_rules.py; it needs root, unshare and nft).
install_nftables() {
    { command -v nft >/dev/null 2>&1 || [[ -x /usr/sbin/nft ]]; } && return 0
    if can_apt; then
        log "installing nftables with apt-get (the egress guard's namespace test)"
        apt_get install -y --no-install-recommends nftables \
            || log "WARNING: apt-get install nftables failed; the egress namespace test will skip"
    else
        log "nftables: no apt-get; the egress namespace test will skip"
    fi
}

# wrk: the load generator of bench/floor.py. A stale package index is refreshed once if the first try fails.
install_wrk() {
    command -v wrk >/dev/null 2>&1 && return 0
    if can_apt; then
        log "installing wrk with apt-get (bench/floor.py)"
        apt_get install -y --no-install-recommends wrk \
            || { apt_get update && apt_get install -y --no-install-recommends wrk; } \
            || log "WARNING: could not install wrk; only bench/floor.py needs it"
    else
        log "WARNING: wrk not installed and apt-get unavailable; only bench/floor.py needs it"
    fi
}

summary_debian() {
    [[ -x /usr/bin/chromium ]] && printf 'chromium     %s  (%s)\n' /usr/bin/chromium "$(/usr/bin/chromium --version 2>/dev/null)"
    command -v wrk >/dev/null 2>&1 && printf 'wrk          %s  (%s)\n' "$(command -v wrk)" "$(wrk -v 2>&1 | head -n1 | awk '{print $2}')"
    return 0
}
