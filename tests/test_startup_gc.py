"""The sidecar's start-up collects only the youngest generation, then freezes what it built and puts the
collector back (``proxy/startup.py``, issue 32); nothing else changes the collector. Each check runs in a fresh
interpreter and reads ``gc``'s state (nothing is timed)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit import REPO

STATE = "import gc, json\nprint(json.dumps([list(gc.get_threshold()), gc.get_freeze_count(), gc.isenabled()]))"


def state_after(code: str) -> tuple[list[int], int, bool]:
    out = subprocess.run([sys.executable, "-c", code + "\n" + STATE], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    thresholds, frozen, enabled = json.loads(out.stdout.splitlines()[-1])
    return thresholds, frozen, enabled


def default_thresholds() -> list[int]:
    return state_after("")[0]


def test_begin_keeps_the_youngest_generation_and_end_restores_and_freezes():
    code = ("import gc\nfrom proxy import startup\nbefore = gc.get_threshold()\nstartup.begin()\n"
            "during = gc.get_threshold()\nstartup.begin()\nassert gc.get_threshold() == during\n"
            "assert startup.starting() and gc.isenabled()\n"
            "assert during[0] == before[0] and min(during[1:]) > 10**6, during\n"
            "startup.end(freeze=True)\nassert not startup.starting() and gc.get_threshold() == before\n"
            "startup.end(freeze=True)  # a second end: nothing to do")
    thresholds, frozen, enabled = state_after(code)
    assert thresholds == default_thresholds() and enabled
    assert frozen > 1000  # the interpreter's and the package's objects went to the permanent generation


def test_end_without_begin_changes_nothing():
    assert state_after("from proxy import startup\nstartup.end(freeze=True)") == (default_thresholds(), 0, True)


def test_importing_the_cli_from_another_program_changes_nothing():
    assert state_after("import proxy.cli") == (default_thresholds(), 0, True)


def test_a_run_that_fails_to_start_puts_the_collector_back_unfrozen():
    code = "from proxy.cli import main\nassert main(['run', '--config', '/nonexistent/toolproxy.yaml']) == 1"
    assert state_after(code) == (default_thresholds(), 0, True)


def test_another_command_under_python_m_ends_the_start_up_unfrozen():
    code = ("import runpy, sys\nsys.argv = ['toolproxy', 'config-reference']\n"
            "try:\n    runpy.run_module('proxy.cli', run_name='__main__')\nexcept SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code")
    assert state_after(code) == (default_thresholds(), 0, True)


ENTRY = """import gc, runpy, sys
older, young = [], []  # collections from cli's first line: while starting (python -m), or all


def count(phase, info):
    startup = sys.modules.get("proxy.startup")  # cli's first import
    if phase == "start" and startup is not None and (startup.starting() or RUN_NAME != "__main__"):
        (older if info["generation"] > 0 else young).append(info["generation"])


gc.callbacks.append(count)
sys.argv = ["toolproxy", "config-reference"]
try:
    runpy.run_module("proxy.cli", run_name=RUN_NAME)
except SystemExit:
    pass
assert "proxy.registry" in sys.modules
print("YOUNG", len(young), "OLDER", len(older))
"""


def older_collections(run_name: str) -> int:
    out = subprocess.run([sys.executable, "-c", f"RUN_NAME = {run_name!r}\n" + ENTRY], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    young, older = (int(n) for n in out.stdout.split()[-3::2])
    assert young > 50  # the imports ran while counted (about 150 young collections)
    return older


def test_the_entry_begins_before_its_imports():
    # python -m proxy.cli imports the serving path (about 600 modules) with young collections only, until
    # `config-reference` ends the start-up right after parsing; the same imports as a plain module collect
    # the older generations about a dozen times.
    assert older_collections("__main__") == 0
    assert older_collections("proxy_cli_as_a_module") > 0
