"""requirements.lock covers pyproject.toml, pins with hashes, and scripts/setup.sh installs exactly it."""

from __future__ import annotations

import importlib.util
import re

from tests.unit import REPO, setup_scripts

_spec = importlib.util.spec_from_file_location("check_lock", REPO / "scripts" / "check_lock.py")
check_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lock)

PYPROJECT = (REPO / "pyproject.toml").read_text(encoding="utf-8")
LOCK = (REPO / "requirements.lock").read_text(encoding="utf-8")


def test_the_lock_covers_every_requirement_of_pyproject_with_hashes():
    """A dependency added to pyproject.toml without `scripts/lock.sh` fails here (and stops scripts/setup.sh)."""
    assert check_lock.lock_problems(PYPROJECT, LOCK) == []
    locked = check_lock.pins(LOCK)
    assert len(locked) > 40 and {"aiohttp", "redis", "pytest", "setuptools"} <= set(locked)


def test_the_check_names_what_is_missing_or_out_of_range():
    stale = PYPROJECT.replace('"orjson>=3.10",', '"orjson>=3.10",\n    "msgpack>=1",')
    assert check_lock.lock_problems(stale, LOCK) == ["msgpack is in pyproject.toml but not in requirements.lock"]
    version = check_lock.pins(LOCK)["aiohttp"][0]
    lower = LOCK.replace(f"aiohttp=={version}", "aiohttp==3.10.0")
    assert check_lock.lock_problems(PYPROJECT, lower) == [
        "requirements.lock pins aiohttp==3.10.0, outside pyproject.toml's aiohttp>=3.14.3"]
    unhashed = "aiohttp==3.14.5\n    # via toolproxy\n"
    assert check_lock.pins(unhashed) == {"aiohttp": ("3.14.5", 0)}


def test_floors_stay_past_known_cves():
    floors = {r.name.lower(): r.specifier for r in check_lock.required(PYPROJECT)}
    for name, vulnerable in (("aiohttp", "3.14.2"), ("pyjwt", "2.11.0")):
        assert not floors[name].contains(vulnerable), (name, vulnerable)


def test_the_lock_is_refreshed_with_the_options_setup_installs_it_with():
    header = re.search(r"^#\s+pip-compile (.*)$", LOCK, flags=re.M).group(1)
    script = (REPO / "scripts" / "lock.sh").read_text(encoding="utf-8")
    for option in ("--generate-hashes", "--allow-unsafe", "--extra=test", "--build-deps-for=editable",
                   "--strip-extras"):
        assert option in header and option.replace("=", " ") in script, option
    setup = setup_scripts()
    assert '--require-hashes -r "$LOCK"' in setup and "--no-deps --no-build-isolation -e" in setup
    assert "check_lock.py\" --installed" in setup
    assert "npm ci" in setup
