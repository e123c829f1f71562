# shellcheck shell=bash
# The helpers every tool family of scripts/setup.sh uses: messages, checksums, downloads, Debian packages.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | awk '{print $1}'
    elif command -v shasum >/dev/null 2>&1; then
        shasum -a 256 "$1" | awk '{print $1}'
    else
        python3 -c 'import hashlib,sys;print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"
    fi
}

fetch() {  # fetch URL DEST
    if command -v curl >/dev/null 2>&1; then
        curl -fsSL --retry 3 -o "$2" "$1"
    elif command -v wget >/dev/null 2>&1; then
        wget -q -O "$2" "$1"
    else
        python3 -c 'import sys,urllib.request;urllib.request.urlretrieve(sys.argv[1],sys.argv[2])' "$1" "$2"
    fi
}

fetch_verified() {  # fetch_verified URL SUM_URL DIR NAME: URL into DIR/NAME, its sha256 the first word of
    # SUM_URL's file (a release's published checksum); a failed download or a mismatch removes DIR and stops.
    local url="$1" sum_url="$2" dir="$3" name="$4" want got
    fetch "$url" "$dir/$name" && fetch "$sum_url" "$dir/$name.sha256" \
        || { rm -rf "$dir"; die "download failed: $url"; }
    want="$(awk '{print $1; exit}' "$dir/$name.sha256")"
    got="$(sha256_of "$dir/$name")"
    [[ -n "$want" && "$want" == "$got" ]] || { rm -rf "$dir"; die "checksum mismatch for $url (want $want, got $got)"; }
}

can_apt() {  # Debian's apt-get is there, and we are root or have passwordless sudo
    command -v apt-get >/dev/null 2>&1 || return 1
    [[ "$(id -u)" == 0 ]] && return 0
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null
}

apt_get() {  # apt_get ARGS...: apt-get quietly, as root or through sudo -n. RUNLEVEL=1 asks invoke-rc.d not
    # to start a packaged service (tests never use port 6379 anyway).
    local sudo=()
    [[ "$(id -u)" == 0 ]] || sudo=(sudo -n)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get -qq "$@" >/dev/null
}
