# shellcheck shell=bash
# Debian packages the tests and benches drive: chromium (the console's browser tests), nftables (the egress
# guard's namespace test) and wrk (bench/floor.py's load generator). Each is optional: without apt-get (root or
# passwordless sudo) setup says which tests skip and goes on.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

apt_optional() {  # apt_optional PACKAGE PURPOSE SKIPS: a Debian package if apt-get can; else say what skips
    local package="$1" purpose="$2" skips="$3"
    if ! can_apt; then
        log "$package: no apt-get; $skips"
        return 0
    fi
    log "installing $package with apt-get ($purpose)"
    # A stale package index is refreshed once if the first try fails.
    apt_get install -y --no-install-recommends "$package" \
        || { apt_get update && apt_get install -y --no-install-recommends "$package"; } \
        || log "WARNING: apt-get install $package failed; $skips"
}

# chromium: the console's browser tests drive it with Playwright for Python; Debian's package, never
# `playwright install`.
install_chromium() {
    [[ -x /usr/bin/chromium ]] \
        || apt_optional chromium "browser tests of the operator console" "the console's browser tests will skip"
}

# nft (Debian's nftables): the egress guard's walk-around test applies the rules of `toolproxy egress-rules`
# in a fresh network namespace (tests/walkaround/test_egress_rules.py; it needs root, unshare and nft).
install_nftables() {
    command -v nft >/dev/null 2>&1 || [[ -x /usr/sbin/nft ]] \
        || apt_optional nftables "the egress guard's namespace test" "the egress namespace test will skip"
}

# wrk: the load generator of bench/floor.py.
install_wrk() {
    command -v wrk >/dev/null 2>&1 || apt_optional wrk "bench/floor.py" "only bench/floor.py needs it"
}

summary_debian() {
    [[ -x /usr/bin/chromium ]] && printf 'chromium     %s  (%s)\n' /usr/bin/chromium "$(/usr/bin/chromium --version 2>/dev/null)"
    command -v wrk >/dev/null 2>&1 && printf 'wrk          %s  (%s)\n' "$(command -v wrk)" "$(wrk -v 2>&1 | head -n1 | awk '{print $2}')"
    return 0
}
