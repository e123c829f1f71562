"""Every Lua script enters the proxy through one place: ``store.lua(name, source)`` declares it in
``store.LUA_SCRIPTS`` and ``store.script`` runs it (EVALSHA, loaded again on NOSCRIPT). A script written as a
bare string and handed to ``register_script`` (or sent with EVAL) would be nameless in traffic checks and
missed by the checks that read the registry; these checks find one."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from proxy import store
from tests.unit import REPO, parsed, walk

PACKAGE = REPO / "proxy"
LUA_CALL = re.compile(r"redis\.p?call\(")
SENDERS = {"register_script", "evalsha", "eval", "eval_ro", "evalsha_ro", "script_load"}  # outside store.py
PLACEHOLDER = re.compile(r"%(\([a-z_]+\))?[ds]")


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def lua_modules() -> list[Path]:
    """The modules holding Lua source (a string literal that calls ``redis.call``)."""
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if any(isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and LUA_CALL.search(node.value) for node in walk(parsed(path))))


def nested_lua(tree: ast.Module) -> list[int]:
    """Lines of Lua string literals that are not (part of) a module-level assignment: out of the registry's
    sight. A module-level one is either declared (``store.lua``) or a fragment of declared scripts."""
    top_level = {id(node) for statement in tree.body if isinstance(statement, (ast.Assign, ast.AnnAssign))
                 for node in walk(statement)}
    return [node.lineno for node in walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and LUA_CALL.search(node.value) and id(node) not in top_level]


def senders(tree: ast.Module) -> list[str]:
    return [f"{node.lineno}: {node.func.attr}(...)" for node in walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SENDERS]


def unregistered(module: object, scripts: list[store.Lua]) -> list[str]:
    """Module-level strings holding Lua that no declared script of the module contains line for line (a
    fragment such as a shared prelude is contained, its placeholders aside)."""
    found = []
    for name, value in vars(module).items():
        if not isinstance(value, str) or not LUA_CALL.search(value):
            continue
        lines = [line.strip() for line in value.splitlines() if line.strip() and not PLACEHOLDER.search(line)]
        sources = [{line.strip() for line in declared.source.splitlines()} for declared in scripts]
        if not any(all(line in source for line in lines) for source in sources):
            found.append(name)
    return found


def test_lua_lives_in_the_modules_the_registry_knows():
    assert {module_of(p) for p in lua_modules()} >= {"proxy.locks", "proxy.operations", "proxy.quotas"}


@pytest.mark.parametrize("path", lua_modules(), ids=module_of)
def test_every_lua_source_of_a_module_is_a_declared_script(path):
    assert not nested_lua(parsed(path)), f"{module_of(path)}: Lua source outside a module-level constant"
    module = importlib.import_module(module_of(path))
    prefix = module_of(path).rsplit(".", 1)[1] + "."
    scripts = [declared for declared in store.LUA_SCRIPTS.values()  # (a chain, "a+b", is made at run time)
               if declared.name.startswith(prefix) and "+" not in declared.name]
    assert scripts, f"{module_of(path)} declares no script with store.lua"
    assert not unregistered(module, scripts), f"{module_of(path)}: Lua not declared with store.lua"
    declared = {value.name for value in vars(module).values() if isinstance(value, store.Lua)}
    assert declared == {s.name for s in scripts}, "each script is a module-level constant of its module"


def test_only_the_store_sends_scripts():
    found = {module_of(p): calls for p in sorted(PACKAGE.rglob("*.py"))
             if p != PACKAGE / "store.py" and (calls := senders(parsed(p)))}
    assert not found, f"run scripts with store.script(redis, store.lua(...)): {found}"


def test_the_checks_see_an_undeclared_script():
    tree = ast.parse('import redis\n_X = """return redis.call(\'GET\', KEYS[1])"""\n'
                     'def f(r):\n    r.register_script("redis.call(\'DEL\', KEYS[1])")\n')
    assert nested_lua(tree) == [4] and senders(tree) == ["4: register_script(...)"]

    class Module:
        _PRELUDE = "local t = redis.call('TIME')\nlocal n = %(count)d\n"
        _STRAY = "return redis.call('DEL', KEYS[1])\n"

    declared = [store.Lua("m.one", "local t = redis.call('TIME')\nlocal n = 3\nreturn n\n")]
    assert unregistered(Module, declared) == ["_STRAY"]


def test_a_name_is_declared_with_one_source():
    store.lua("tests.same", "return 1")
    assert store.lua("tests.same", "return 1").sha == store.LUA_SCRIPTS["tests.same"].sha
    with pytest.raises(ValueError, match="tests.same"):
        store.lua("tests.same", "return 2")
    del store.SCRIPT_NAMES[store.LUA_SCRIPTS.pop("tests.same").sha]
