"""The unit tier stays in one interpreter: no test file below tests/unit starts a process (a fresh
interpreter, a server). Such a test lives one directory up, where the whole suite runs it; here it would
cost ``scripts/test.sh --fast`` an interpreter start per test."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit import parsed, walk

HERE = Path(__file__).resolve().parent
PROCESS_MODULES = {"subprocess", "multiprocessing", "concurrent.futures.process", "pty"}
PROCESS_CALLS = {"create_subprocess_exec", "create_subprocess_shell", "system", "popen", "fork", "spawnv",
                 "execv", "execvp", "ProcessPoolExecutor"}


def process_starts(tree: ast.AST) -> list[str]:
    """What in ``tree`` imports a process module or calls a process-starting function, by line."""
    found = []
    for node in walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in PROCESS_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in PROCESS_MODULES:
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in PROCESS_CALLS:
                found.append(f"{node.lineno}: {name}(...)")
    return found


def test_the_check_sees_each_way_to_start_a_process():
    source = ("import subprocess\nfrom multiprocessing import Process\nimport asyncio, os\n"
              "asyncio.create_subprocess_exec('x')\nos.system('x')\n")
    assert process_starts(ast.parse(source)) == [
        "1: import subprocess", "2: from multiprocessing import ...", "4: create_subprocess_exec(...)",
        "5: system(...)"]
    assert process_starts(ast.parse("import asyncio\nasyncio.sleep(0)\n")) == []


def test_no_unit_test_starts_a_process():
    found = {str(path.relative_to(HERE)): starts for path in sorted(HERE.rglob("*.py"))
             if (starts := process_starts(parsed(path)))}
    assert not found, f"move these to tests/ (the full suite): {found}"
