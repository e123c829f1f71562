"""Check requirements.lock against pyproject.toml and, with ``--installed``, against the environment.

Owns: reading the lock's pins (``name==version`` with at least one ``--hash``), the rule that the lock
covers every requirement pyproject.toml names for this platform (its dependencies and the [test] extra,
each pinned at a version its range allows), and with ``--installed`` that every pin is installed at
exactly its version. scripts/setup.sh runs it after installing the lock; tests/unit/test_lock.py runs the
first half. Exit status 0 when all holds, else 1 with one line per problem and what to run.
Must never: change the lock or the environment (scripts/lock.sh and scripts/setup.sh do).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pins(lock_text: str) -> dict[str, tuple[str, int]]:
    """{canonical name: (version, number of hashes)} of every ``name==version`` entry of a lock."""
    found: dict[str, tuple[str, int]] = {}
    current = None
    for line in lock_text.splitlines():
        match = PIN.match(line)
        if match:
            current = canonicalize_name(match.group(1))
            found[current] = (match.group(2), 0)
        elif current is not None and line.strip().startswith("--hash="):
            version, hashes = found[current]
            found[current] = (version, hashes + 1)
        elif not line.startswith(" "):
            current = None
    return found


def required(pyproject_text: str, extras: tuple[str, ...] = ("test",)) -> list[Requirement]:
    """pyproject.toml's dependencies plus the given extras, for this platform (markers evaluated)."""
    project = tomllib.loads(pyproject_text)["project"]
    texts = list(project.get("dependencies", []))
    for extra in extras:
        texts += project.get("optional-dependencies", {}).get(extra, [])
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def lock_problems(pyproject_text: str, lock_text: str) -> list[str]:
    """What the lock lacks for pyproject.toml: unpinned or out-of-range requirements, pins without hashes."""
    locked = pins(lock_text)
    problems = []
    for requirement in required(pyproject_text):
        name = canonicalize_name(requirement.name)
        if name not in locked:
            problems.append(f"{requirement.name} is in pyproject.toml but not in requirements.lock")
        elif not requirement.specifier.contains(locked[name][0], prereleases=True):
            problems.append(f"requirements.lock pins {requirement.name}=={locked[name][0]}, outside pyproject.toml's "
                            f"{requirement}")
    problems += [f"requirements.lock pins {name}=={version} without a hash"
                 for name, (version, hashes) in sorted(locked.items()) if hashes == 0]
    return problems


def installed_problems(lock_text: str) -> list[str]:
    """Pins that are not installed at exactly their version."""
    problems = []
    for name, (version, _) in sorted(pins(lock_text).items()):
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name}=={version} is locked but not installed")
            continue
        if Version(have) != Version(version):
            problems.append(f"{name} is installed at {have}, locked at {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--installed", action="store_true", help="also check the running environment")
    args = parser.parse_args(argv)
    lock_text = (ROOT / "requirements.lock").read_text(encoding="utf-8")
    problems = lock_problems((ROOT / "pyproject.toml").read_text(encoding="utf-8"), lock_text)
    if problems:
        problems.append("requirements.lock is out of date with pyproject.toml: run scripts/lock.sh")
    elif args.installed:
        problems = installed_problems(lock_text)
    for problem in problems:
        print(f"check_lock: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_lock: {len(pins(lock_text))} locked packages"
              + (" installed at their pinned versions" if args.installed else " cover pyproject.toml"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
