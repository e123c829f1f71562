"""redis-py is first imported without OpenTelemetry's metrics SDK (``proxy/wire/redis_py.py``, issue 32), and
what that relies on still holds: redis-py is pinned exactly, its first import still reaches for the SDK (else
the block is dead code), only its providers module does, and the block is lifted afterwards. Each check runs in
a fresh interpreter and reads its ``sys.modules`` (nothing is timed)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from proxy.wire.redis_py import OTEL_METRICS_SDK
from tests.unit import REPO
from tests.test_lazy_imports import imported_after

REDIS_FLAG = "import redis.observability.providers as p\nprint('OTEL_AVAILABLE', p.OTEL_AVAILABLE)"


def run(code: str) -> tuple[set[str], str]:
    """The modules a fresh interpreter holds after ``code``, and what ``code`` printed."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    *printed, modules = out.stdout.splitlines()
    return set(json.loads(modules)), "\n".join(printed)


def test_redis_py_is_pinned_exactly_to_the_installed_version():
    pins = re.findall(r'"redis==([^"]+)"', (REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pins == [version("redis")], "redis must be pinned exactly (proxy/wire/redis_py.py relies on its imports)"


def test_redis_py_alone_still_imports_the_metrics_sdk():
    # What the block spares: if a redis-py upgrade stops importing the SDK, this fails and the block can go.
    modules, printed = run("import redis\n" + REDIS_FLAG)
    assert OTEL_METRICS_SDK in modules and "OTEL_AVAILABLE True" in printed


def sdk_imports(source: str) -> list[tuple[str, bool]]:
    """Each import of the SDK in ``source`` (docstrings aside): its module, and whether a function makes it."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [child.module or ""] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                found.extend((name, in_function) for name in names if name.startswith("opentelemetry.sdk"))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def test_only_redis_pys_providers_module_imports_the_sdk_when_imported():
    # The block hides the SDK from every redis-py module imported meanwhile: only providers.py may want it, and
    # only for its OTEL_AVAILABLE flag and an annotation (its metrics use the API's global meter provider).
    import redis
    package = Path(redis.__file__).parent
    at_import = {str(path.relative_to(package)): [name for name, in_function in sdk_imports(path.read_text("utf-8"))
                                                  if not in_function]
                 for path in package.rglob("*.py")}
    assert {path: names for path, names in at_import.items() if names} == \
        {"observability/providers.py": [OTEL_METRICS_SDK]}
    providers = (package / "observability" / "providers.py").read_text(encoding="utf-8")
    assert providers.count("OTEL_AVAILABLE") == 2  # set in the try and in the except, read nowhere in it
    flags = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                   if "OTEL_AVAILABLE" in path.read_text(encoding="utf-8"))
    assert flags == ["observability/metrics.py", "observability/providers.py"]  # metrics.py: its own, of the API


def test_the_proxys_redis_import_spares_the_sdk_and_lifts_the_block():
    modules, printed = run("import proxy.store\nimport proxy.wire.redis_py as r\nprint('BLOCKED', r.BLOCKED_ON_FIRST_IMPORT)\n"
                           + REDIS_FLAG + f"\nimport sys\nprint('AFTER', {OTEL_METRICS_SDK!r} in sys.modules)\n"
                           "from opentelemetry.sdk.metrics import MeterProvider\nprint('IMPORTABLE', MeterProvider.__name__)")
    assert "BLOCKED True" in printed and "OTEL_AVAILABLE False" in printed and "AFTER False" in printed
    assert "IMPORTABLE MeterProvider" in printed  # the block was lifted: anyone may import the SDK later
    assert "redis.asyncio" in modules


def test_an_sdk_already_in_use_is_not_hidden():
    _, printed = run("import opentelemetry.sdk.metrics\nimport proxy.wire.redis_py as r\n"
                     "print('BLOCKED', r.BLOCKED_ON_FIRST_IMPORT)\n" + REDIS_FLAG)
    assert "BLOCKED False" in printed and "OTEL_AVAILABLE True" in printed


def test_the_run_entry_imports_redis_py_through_the_block():
    # A module that imports redis-py before proxy/wire/redis_py.py would bring the SDK back: this sees it.
    modules = imported_after("from proxy.cli import main\nmain(['run', '--config', '/nonexistent/toolproxy.yaml'])")
    assert "redis.asyncio" in modules and "proxy.store" in modules
    assert OTEL_METRICS_SDK not in modules
