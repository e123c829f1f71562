# shellcheck shell=bash
# The Go tools: pinned opa and helm, promtool, jaeger, kube-apiserver and kine, built in one background job
# (start_go_tools; a second one downloads their modules meanwhile) while the network-bound steps run;
# wait_go_tools collects them before the summary.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

OPA_VERSION="v1.22.3"
OPA_MODULE="github.com/open-policy-agent/opa"
HELM_VERSION="v3.22.0"
HELM_MODULE="helm.sh/helm/v3/cmd/helm"

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
    local url="https://openpolicyagent.org/downloads/${OPA_VERSION}/${asset}" tmp
    tmp="$(mktemp -d)"
    fetch_verified "$url" "$url.sha256" "$tmp" opa
    chmod +x "$tmp/opa"
    mv -f "$tmp/opa" "$1/opa"
    rm -rf "$tmp"
}

download_helm() {  # download_helm DESTDIR
    detect_platform
    local tarball="helm-${HELM_VERSION}-${OS}-${ARCH}.tar.gz" tmp
    local url="https://get.helm.sh/${tarball}"
    tmp="$(mktemp -d)"
    fetch_verified "$url" "$url.sha256sum" "$tmp" "$tarball"
    tar -xzf "$tmp/$tarball" -C "$tmp"
    chmod +x "$tmp/${OS}-${ARCH}/helm"
    mv -f "$tmp/${OS}-${ARCH}/helm" "$1/helm"
    rm -rf "$tmp"
}

in_tools_cache() {  # in_tools_cache NAME VERSION: NAME built from its module at VERSION (its VERSION file says)
    local dir="$TOOLS_CACHE/$1-$2"
    [[ -x "$dir/$1" && "$(cat "$dir/VERSION" 2>/dev/null)" == "$2" ]]
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
# the build fails, the rule tests fall back to the Python PromQL checker. remove_all_sd (Prometheus' own build
# tag) leaves out the service-discovery plugins (AWS, Azure, GCE, Consul, ... : 247 of 1,364 packages), which
# `promtool check rules` and `promtool test rules` never use.
PROMTOOL_VERSION="v0.316.0"
PROMTOOL_MODULE="github.com/prometheus/prometheus/cmd/promtool"
PROMTOOL_TAGS="remove_all_sd"
install_promtool() {
    local dir="$TOOLS_CACHE/promtool-${PROMTOOL_VERSION}"
    if ! in_tools_cache promtool "$PROMTOOL_VERSION"; then
        command -v go >/dev/null 2>&1 || { log "promtool: no Go toolchain, skipped"; return 0; }
        mkdir -p "$dir"
        log "building promtool $PROMTOOL_VERSION with go install (once; cache: $dir)"
        if GOBIN="$dir" go install -tags "$PROMTOOL_TAGS" -ldflags '-s -w' "${PROMTOOL_MODULE}@${PROMTOOL_VERSION}"; then
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
jaeger_module_dir() {  # the module's directory in the module cache (downloaded if it is not there), or nothing
    go mod download -json "github.com/jaegertracing/jaeger@${JAEGER_VERSION}" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'
}
build_jaeger() {  # build_jaeger MODULE_DIR OUT slim|full [GO_BUILD_FLAGS...]: a scratch copy of the module, built into OUT
    local src="$1" out="$2" kind="$3" scratch rc=0
    shift 3
    scratch="$(mktemp -d)"
    cp -r "$src/." "$scratch/" && chmod -R u+w "$scratch" || rc=1
    if [[ $rc == 0 && $kind == slim ]]; then
        # GIT_CEILING_DIRECTORIES: the scratch copy is never taken for part of an enclosing repository.
        (cd "$scratch" && GIT_CEILING_DIRECTORIES="$(dirname "$scratch")" git apply "$JAEGER_PATCH") || rc=1
    fi
    local pkg=./cmd/jaeger
    [[ $kind == slim ]] && pkg=./cmd/jaeger/slim
    if [[ $rc == 0 ]]; then
        (cd "$scratch" && go build -trimpath -ldflags='-s -w' "$@" -o "$out" "$pkg") || rc=1
    fi
    rm -rf "$scratch"
    return "$rc"
}
install_jaeger() {
    local dir="$TOOLS_CACHE/jaeger-${JAEGER_VERSION}"
    if ! in_tools_cache jaeger "$JAEGER_VERSION"; then
        command -v go >/dev/null 2>&1 || { log "jaeger: no Go toolchain, skipped (trace tests need it)"; return 0; }
        mkdir -p "$dir"
        rm -f "$dir/VERSION" "$dir/BUILD"
        local src kind=slim
        src="$(jaeger_module_dir)" || src=""
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
KINE_MODULE="github.com/k3s-io/kine"
install_kube_apiserver() {
    local dir="$TOOLS_CACHE/kube-apiserver-${KUBE_APISERVER_VERSION}" minor
    if ! in_tools_cache kube-apiserver "$KUBE_APISERVER_VERSION"; then
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
    if ! in_tools_cache kine "$KINE_VERSION"; then
        command -v go >/dev/null 2>&1 || { log "kine: no Go toolchain, skipped (the admission tests need it)"; return 0; }
        mkdir -p "$dir"
        rm -f "$dir/VERSION"
        log "building kine $KINE_VERSION with go install (once; cache: $dir)"
        if ! GOBIN="$dir" go install -ldflags "-s -w -X github.com/k3s-io/kine/pkg/version.Version=${KINE_VERSION}" \
                "${KINE_MODULE}@${KINE_VERSION}"; then
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
# mostly waiting on the network, get the CPU when they need it. Each tool logs to $SETUP_LOGS/<tool>.log;
# wait_go_tools prints what was built and any warning, and on a failure the log's end and stops setup.
GO_TOOLS=(opa helm promtool jaeger kube-apiserver kine)
GO_TOOLS_PID=""
GO_MODULES_PID=""
run_logged() {  # run_logged NAME COMMAND...: COMMAND's output into $SETUP_LOGS/NAME.log, and if it built, its
    # wall time and its CPU time (user + sys of every process it ran: the go commands, compilers, linker, cc)
    local name="$1" log="$SETUP_LOGS/$1.log" TIMEFORMAT
    shift
    TIMEFORMAT="setup: $name: %0R s (CPU %0U s user + %0S s sys)"
    { time "$@" > "$log" 2>&1; } 2> "$log.time"
    [[ -s "$log" ]] && cat "$log.time" >> "$log"
    rm -f "$log.time"
    return 0
}
# The modules every build after opa's needs, downloaded while opa compiles (`go build -n` resolves and fetches
# them, and compiles nothing): each build then finds its modules in place instead of first waiting on the
# network with both cores idle (about 25 s a tool here). Best effort: a build still fetches what is missing.
fetch_only() {  # fetch_only COMMAND...: a dry run (-n) whose script of commands is left out of the log
    "$@" 2>&1 | grep -E '^go: |^[^[:space:]]+\.go:[0-9]+:' || true  # go's messages, a package's errors
}
prefetch_go_modules() {  # in a background job of its own; a tool whose modules cannot be fetched is skipped
    local src
    # First opa's own modules, which its build is fetching at this moment: the module cache's locks make this
    # wait for them (or fetch some alongside), so the other tools' modules do not take the network from the
    # one build waiting on it with both cores idle (150 to 330 s of opa's build were that wait).
    tool_version_ok opa "$TOOLS_CACHE/opa-${OPA_VERSION}/opa" "$OPA_VERSION" \
        || fetch_only go install -n "${OPA_MODULE}@${OPA_VERSION}"
    tool_version_ok helm "$TOOLS_CACHE/helm-${HELM_VERSION}/helm" "$HELM_VERSION" \
        || fetch_only go install -n "${HELM_MODULE}@${HELM_VERSION}"
    in_tools_cache promtool "$PROMTOOL_VERSION" \
        || fetch_only go install -n -tags "$PROMTOOL_TAGS" "${PROMTOOL_MODULE}@${PROMTOOL_VERSION}"
    if ! in_tools_cache jaeger "$JAEGER_VERSION"; then
        src="$(jaeger_module_dir)" && [[ -n "$src" ]] && fetch_only build_jaeger "$src" /dev/null slim -n
    fi
    in_tools_cache kube-apiserver "$KUBE_APISERVER_VERSION" \
        || (cd "$ROOT/scripts/kube-apiserver" && fetch_only go build -n k8s.io/kubernetes/cmd/kube-apiserver)
    in_tools_cache kine "$KINE_VERSION" || fetch_only go install -n "${KINE_MODULE}@${KINE_VERSION}"
    return 0
}
background_go_env() {  # in a job: nice 10 at least, and -trimpath for every build (one build cache)
    local niceness
    niceness="$(nice)"
    (( niceness < 10 )) && { renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true; }
    GOFLAGS="$(go env GOFLAGS)"
    [[ " $GOFLAGS " == *" -trimpath "* ]] || GOFLAGS="${GOFLAGS:+$GOFLAGS }-trimpath"
    export GOFLAGS
}
go_tools_job() {
    if command -v go >/dev/null 2>&1; then background_go_env; fi
    # -s -w: no symbol table or DWARF, which nothing here reads (the link's share of the CPU).
    run_logged opa install_tool opa "$OPA_VERSION" "$OPA_MODULE" -ldflags '-s -w'
    # Helm's release build stamps its version via ldflags (the source default is
    # only "v3.22"); do the same so `helm version` reports the exact pin.
    run_logged helm install_tool helm "$HELM_VERSION" "$HELM_MODULE" \
        -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
    run_logged promtool install_promtool
    run_logged jaeger install_jaeger
    run_logged kube-apiserver install_kube_apiserver
    run_logged kine install_kine
}
go_modules_job() {
    background_go_env
    run_logged go-modules prefetch_go_modules
}
start_go_tools() {
    mkdir -p "$SETUP_LOGS"
    local name
    for name in "${GO_TOOLS[@]}"; do : > "$SETUP_LOGS/$name.log"; done
    # Each job its own process group (set -m), so that leaving setup early stops the whole build with it. The
    # module prefetch is a job of its own, beside the builds: the CPU each build logs is its own.
    set -m
    if command -v go >/dev/null 2>&1; then
        go_modules_job < /dev/null &
        GO_MODULES_PID=$!
    fi
    go_tools_job < /dev/null &
    GO_TOOLS_PID=$!
    set +m
}
stop_go_modules() {  # the prefetch, needed no more once the builds are done (or stopped)
    if [[ -n "$GO_MODULES_PID" ]]; then
        kill -TERM -- "-$GO_MODULES_PID" 2>/dev/null || true
        wait "$GO_MODULES_PID" 2>/dev/null || true
        GO_MODULES_PID=""
    fi
    return 0
}
stop_go_tools() {
    if [[ -n "$GO_TOOLS_PID" ]]; then kill -TERM -- "-$GO_TOOLS_PID" 2>/dev/null || true; fi
    stop_go_modules
}
wait_go_tools() {
    local rc=0 name start=$SECONDS
    wait "$GO_TOOLS_PID" || rc=$?
    GO_TOOLS_PID=""
    stop_go_modules
    for name in "${GO_TOOLS[@]}"; do
        # Our own lines: what was built, how long it took, warnings. A warning or an error shows the log's end.
        grep '^setup: ' "$SETUP_LOGS/$name.log" >&2 || true
        if grep -q '^setup: \(WARNING\|ERROR\)' "$SETUP_LOGS/$name.log"; then
            log "the end of $SETUP_LOGS/$name.log:"
            tail -n 25 "$SETUP_LOGS/$name.log" | grep -v '^setup: ' | sed 's/^/    /' >&2 || true
        fi
    done
    grep '^setup: ' "$SETUP_LOGS/go-modules.log" >&2 2>/dev/null || true  # the prefetch's time, if it ended
    (( SECONDS - start > 1 )) && log "waited $((SECONDS - start)) s for the Go tools after the other steps"
    (( rc == 0 )) || die "the Go tools' build failed (exit $rc; logs: $SETUP_LOGS)"
}

summary_go_tools() {
    printf 'opa          %s -> %s  (%s)\n' "$VBIN/opa" "$(readlink "$VBIN/opa")" \
        "$("$VBIN/opa" version | awk -F': *' '$1=="Version"{print "v"$2; exit}')"
    printf 'helm         %s -> %s  (%s)\n' "$VBIN/helm" "$(readlink "$VBIN/helm")" \
        "$("$VBIN/helm" version --short 2>/dev/null)"
    [[ -x "$VBIN/promtool" ]] && printf 'promtool     %s -> %s  (%s)\n' "$VBIN/promtool" "$(readlink "$VBIN/promtool")" \
        "$(cat "$(dirname "$(readlink "$VBIN/promtool")")/VERSION")"
    [[ -x "$VBIN/jaeger" ]] && printf 'jaeger       %s -> %s  (%s, %s build)\n' "$VBIN/jaeger" "$(readlink "$VBIN/jaeger")" \
        "$(cat "$(dirname "$(readlink "$VBIN/jaeger")")/VERSION")" \
        "$(cat "$(dirname "$(readlink "$VBIN/jaeger")")/BUILD" 2>/dev/null || echo full)"
    local tool
    for tool in kube-apiserver kine; do
        if [[ -x "$VBIN/$tool" ]]; then
            printf '%-12s %s -> %s  (%s)\n' "$tool" "$VBIN/$tool" "$(readlink "$VBIN/$tool")" \
                "$(cat "$(dirname "$(readlink "$VBIN/$tool")")/VERSION")"
        fi
    done
    return 0
}
