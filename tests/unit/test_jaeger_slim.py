"""scripts/jaeger-slim.patch: one Jaeger pin everywhere, and the slim build holds every component the trace tests run.

scripts/setup.sh builds ``./cmd/jaeger/slim`` (added by the patch) as the ``jaeger`` of tests/test_traces.py; a
component added to tests/support/traces.py's configuration but missing from that main would fail the trace
tests only where the slim build ran, so it fails here first.
"""

from __future__ import annotations

import re

from tests.unit import REPO, setup_scripts

SETUP = setup_scripts()
PATCH = (REPO / "scripts" / "jaeger-slim.patch").read_text(encoding="utf-8")
TRACES = (REPO / "tests" / "support" / "traces.py").read_text(encoding="utf-8")

# Component name in the collector's configuration -> the Go package whose factory provides it.
PACKAGES = {
    "otlp": "go.opentelemetry.io/collector/receiver/otlpreceiver",
    "jaeger_storage_exporter": "github.com/jaegertracing/jaeger/cmd/jaeger/internal/exporters/storageexporter",
    "jaeger_storage": "github.com/jaegertracing/jaeger/cmd/jaeger/internal/extension/jaegerstorage",
    "jaeger_query": "github.com/jaegertracing/jaeger/cmd/jaeger/internal/extension/jaegerquery",
    "healthcheckv2": "github.com/open-telemetry/opentelemetry-collector-contrib/extension/healthcheckv2extension",
}


def _patched_files() -> dict[str, str]:
    """The patch's added lines, by file."""
    files: dict[str, str] = {}
    for chunk in PATCH.split("\ndiff --git ")[1:]:
        name = chunk.split()[1].removeprefix("b/")
        files[name] = "\n".join(line[1:] for line in chunk.splitlines() if line.startswith("+")
                                and not line.startswith("+++"))
    return files


def test_one_jaeger_pin_in_setup_the_tests_and_the_patch():
    pin = re.search(r'^JAEGER_VERSION="(v[0-9.]+)"$', SETUP, re.M).group(1)
    assert re.search(rf'^JAEGER_VERSION = "{re.escape(pin)}"', TRACES, re.M)
    assert f"Jaeger v2 {pin}" in PATCH.splitlines()[0]
    assert f'Version:     "{pin}-slim"' in _patched_files()["cmd/jaeger/slim/main.go"]


def test_the_patch_changes_only_the_files_its_header_names():
    assert sorted(_patched_files()) == [
        "cmd/jaeger/internal/extension/jaegerstorage/config.go",
        "cmd/jaeger/internal/extension/jaegerstorage/extension.go",
        "cmd/jaeger/slim/main.go",
        "cmd/query/app/flags.go",
    ]


def test_the_slim_main_registers_every_component_the_trace_tests_configure():
    config = TRACES.split('CONFIG = """', 1)[1].split('"""', 1)[0]
    used = {name.strip() for kind in ("receivers", "processors", "exporters", "connectors", "extensions")
            for found in re.findall(rf"^\s*{kind}: \[([^\]]*)\]", config, re.M) for name in found.split(",")}
    assert used == set(PACKAGES), f"add {sorted(used - set(PACKAGES))} to cmd/jaeger/slim in scripts/jaeger-slim.patch"
    main = _patched_files()["cmd/jaeger/slim/main.go"]
    for name, package in PACKAGES.items():
        assert f'"{package}"' in main, name
        assert f"{package.rsplit('/', 1)[1]}.NewFactory()" in main, name
