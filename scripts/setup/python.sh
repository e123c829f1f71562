# shellcheck shell=bash
# Python: the .venv with the locked packages, the verifier's wheels, the chart checks' own venv, and
# (--contextforge) ContextForge's.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

# The virtualenv, created first: the Go tools link into .venv/bin; its packages are installed
# (install_locked_packages) while the Go tools build.
create_venv() {
    if [[ ! -x "$VBIN/python" ]]; then
        log "creating $VENV"
        python3 -m venv "$VENV"
    fi
}

# The locked dependencies first (requirements.lock: exact versions with hashes, scripts/lock.sh refreshes
# it), then toolproxy itself, editable, with --no-deps (a local project has no hash) and the locked
# setuptools as its build backend (--no-build-isolation: nothing unlocked is fetched to build it).
# Reinstalled only when pyproject.toml or the lock changed since the last successful install.
LOCK="$ROOT/requirements.lock"
STAMP="$VENV/.toolproxy-install.sha256"
install_locked_packages() {
    [[ -f "$ROOT/pyproject.toml" && -f "$LOCK" ]] || die "pyproject.toml or requirements.lock missing in $ROOT"
    local want have
    want="$(sha256_of "$ROOT/pyproject.toml") $(sha256_of "$LOCK")"
    have="$(cat "$STAMP" 2>/dev/null || true)"
    if [[ "$want" != "$have" ]]; then
        log "installing the locked dependencies (requirements.lock, pip --require-hashes)"
        "$VBIN/python" -m pip install -q --disable-pip-version-check --require-hashes -r "$LOCK"
        log "installing toolproxy into .venv (pip install --no-deps -e .)"
        "$VBIN/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
        # The lock covers pyproject.toml, and every locked version is the one installed.
        "$VBIN/python" "$ROOT/scripts/check_lock.py" --installed \
            || die "the environment does not match requirements.lock (see above)"
        printf '%s\n' "$want" > "$STAMP"
    fi
}

# The call-token verifier's own dependencies as wheels, the locked versions with their hashes checked:
# tests/test_verifier_package.py installs toolproxy-verifier alone into a clean venv from them, offline.
VERIFIER_WHEELS="$TOOLS_CACHE/verifier-wheels"
VERIFIER_DEPS="cffi cryptography pycparser pyjwt rfc8785"  # PyJWT[crypto] and rfc8785, with what they need
fetch_verifier_wheels() {
    local verifier_reqs verifier_want
    verifier_reqs="$(awk -v names=" $VERIFIER_DEPS " '
        /^[a-z0-9]/ { split($1, nv, "=="); keep = index(names, " " nv[1] " ") > 0 }
        keep && !/^ *#/ { print }' "$LOCK")"
    verifier_want="$(printf '%s' "$verifier_reqs" | sha256sum | cut -d' ' -f1)"
    if [[ "$(cat "$VERIFIER_WHEELS/.requirements.sha256" 2>/dev/null || true)" != "$verifier_want" ]]; then
        log "fetching the verifier's dependencies as wheels (toolproxy-verifier's clean-venv test)"
        mkdir -p "$VERIFIER_WHEELS"
        printf '%s\n' "$verifier_reqs" > "$VERIFIER_WHEELS/requirements.txt"
        "$VBIN/python" -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
            --only-binary=:all: -d "$VERIFIER_WHEELS" -r "$VERIFIER_WHEELS/requirements.txt"
        printf '%s\n' "$verifier_want" > "$VERIFIER_WHEELS/.requirements.sha256"
    fi
}

# Chart checks: checkov and kubernetes-validate (scripts/check-chart.sh), in a venv of their own
# (.tools/chartcheck-venv) so their dependencies never clash with the app's. Reinstalled only when the pins
# change.
CHARTCHECK_VENV="$ROOT/.tools/chartcheck-venv"
CHARTCHECK_PINS="checkov==3.3.30 kubernetes-validate==1.37.0"
CHARTCHECK_STAMP="$CHARTCHECK_VENV/.toolproxy-pins"
install_chart_checks() {
    if [[ "$(cat "$CHARTCHECK_STAMP" 2>/dev/null || true)" != "$CHARTCHECK_PINS" ]]; then
        log "installing $CHARTCHECK_PINS into $CHARTCHECK_VENV (once; a few minutes)"
        [[ -x "$CHARTCHECK_VENV/bin/python" ]] || python3 -m venv "$CHARTCHECK_VENV"
        # shellcheck disable=SC2086  # the pins are separate words
        "$CHARTCHECK_VENV/bin/python" -m pip install -q --disable-pip-version-check $CHARTCHECK_PINS
        printf '%s\n' "$CHARTCHECK_PINS" > "$CHARTCHECK_STAMP"
    fi
}

# AgentDojo (the prompt-injection benchmark python -m bench.injection replays) with its dependencies, in a venv
# of its own: they include LLM clients the proxy never needs. Exactly bench/injection/requirements.lock (pip
# --require-hashes), built once per lock in the tools cache and linked as .tools/agentdojo-venv.
install_agentdojo() {
    local lock="$ROOT/bench/injection/requirements.lock" want venv
    want="$(sha256_of "$lock")"
    venv="$TOOLS_CACHE/agentdojo-venv-${want:0:16}"
    if [[ "$(cat "$venv/.toolproxy-lock.sha256" 2>/dev/null || true)" != "$want" ]]; then
        log "installing AgentDojo into $venv (bench/injection/requirements.lock; once, a minute or two)"
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes -r "$lock"
        printf '%s\n' "$want" > "$venv/.toolproxy-lock.sha256"
    fi
    mkdir -p "$ROOT/.tools"
    ln -sfn "$venv" "$ROOT/.tools/agentdojo-venv"
}

# Optional (--contextforge): IBM ContextForge for the comparison in bench/floor.py, in its own virtualenv
# under .tools/ (it pins its own versions of shared libraries).
CONTEXTFORGE_VERSION="1.0.7"
install_contextforge() {
    local cf="$ROOT/.tools/contextforge"
    if [[ "$("$cf/bin/python" -c 'import importlib.metadata as m; print(m.version("mcp-contextforge-gateway"))' 2>/dev/null)" != "$CONTEXTFORGE_VERSION" ]]; then
        log "installing mcp-contextforge-gateway $CONTEXTFORGE_VERSION into .tools/contextforge"
        python3 -m venv "$cf"
        "$cf/bin/python" -m pip install -q --disable-pip-version-check "mcp-contextforge-gateway==$CONTEXTFORGE_VERSION"
    fi
}

summary_python() {  # versions from the venvs' metadata: `checkov --version` and `pip show` took 30 s of a cached run
    local meta='import importlib.metadata as m, sys; print(*(m.version(name) for name in sys.argv[1:]))' versions
    versions="$("$CHARTCHECK_VENV/bin/python" -c "$meta" checkov kubernetes-validate)"
    printf 'checkov      %s  (%s; kubernetes-validate %s)\n' "$CHARTCHECK_VENV/bin/checkov" "${versions% *}" "${versions#* }"
    printf 'agentdojo    %s  (%s)\n' "$ROOT/.tools/agentdojo-venv" \
        "$("$ROOT/.tools/agentdojo-venv/bin/python" -c "$meta" agentdojo 2>/dev/null)"
}
