# shellcheck shell=bash
# Java tools for the credential tests, in their own background job: Keycloak's server distribution
# (org.keycloak:keycloak-quarkus-dist from Maven Central through mvn, its sha256 checked), unpacked into the
# tools cache and linked as .venv/keycloak. Its first start builds (Quarkus augmentation, about two minutes
# of CPU here): done once in this job, so a test session's start is the server's alone (tens of seconds).
# And Spring Authorization Server (tests/authserver), built with mvn once per digest of its sources.
# Sourced by scripts/setup.sh (the one entry point: run that, never this file). Defines functions only;
# the entry point calls them in order. Uses ROOT, VENV, VBIN, TOOLS_CACHE and SETUP_LOGS from it.

KEYCLOAK_VERSION="26.5.6"
KEYCLOAK_SHA256="490189d9dff05272432d51f71a069462eeca97f2920a694d539a1e6c26a5a347"
JAVA_LOG="$SETUP_LOGS/java-tools.log"
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
        while kill -0 "$kc" 2>/dev/null && ! grep -qs "Listening on" "$dir/build.log"; do sleep 2; done
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
start_java_tools() {
    mkdir -p "$SETUP_LOGS"
    # Its own process group (set -m), so that leaving setup early stops the whole job with it.
    set -m
    java_tools_job < /dev/null > "$JAVA_LOG" 2>&1 &
    JAVA_TOOLS_PID=$!
    set +m
}
stop_java_tools() {
    if [[ -n "$JAVA_TOOLS_PID" ]]; then kill -TERM -- "-$JAVA_TOOLS_PID" 2>/dev/null || true; fi
    return 0
}
wait_java_tools() {
    local rc=0
    wait "$JAVA_TOOLS_PID" || rc=$?
    JAVA_TOOLS_PID=""
    grep '^setup: ' "$JAVA_LOG" >&2 || true
    (( rc == 0 )) || die "the Java tools failed (exit $rc; log: $JAVA_LOG)"
}

summary_java() {
    [[ -f "$VENV/authserver.jar" ]] && printf 'authserver   %s -> %s\n' "$VENV/authserver.jar" "$(readlink "$VENV/authserver.jar")"
    [[ -x "$VENV/keycloak/bin/kc.sh" ]] && printf 'keycloak     %s -> %s  (%s)\n' "$VENV/keycloak" "$(readlink "$VENV/keycloak")" \
        "$KEYCLOAK_VERSION"
    return 0
}
