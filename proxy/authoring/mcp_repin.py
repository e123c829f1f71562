"""``toolproxy mcp repin FILE...``: record a reviewed upstream change as the registry's new pins.

Owns: listing each upstream the given registry files pin (or could pin: MCP
contracts without ``backend.pin`` get one), printing per tool what changed
against its pins (the diff ``proxy/drift.py`` writes), and writing the new
digests into the files by editing only the ``pin`` values (or inserting a
``pin`` into the backend mapping) at the positions the YAML parser reports,
so comments and layout stay as they were; the edited file is validated
before it replaces the old one.

Must never: change anything of a contract but ``backend.pin`` (the
description and schemas the model sees stay the reviewer's), pin a tool the
upstream no longer lists, or leave a half-written or invalid registry file.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

import yaml

from ..drift import UNREPRESENTABLE, Drift, UpstreamTool, compare, definition_digest, list_digest
from ..registry import McpPin, RegistryError, ToolContract, load_file


@dataclass(frozen=True)
class Repin:
    contract: ToolContract
    index: int             # the entry's position in its file's tools list
    new: McpPin | None     # None: the upstream no longer lists the tool (left as it was)
    drift: Drift | None    # what changed against the old pin (None: nothing, or no old pin)


def plan(contracts: Sequence[tuple[int, ToolContract]], listed: Sequence[UpstreamTool]) -> list[Repin]:
    """The new pins of one upstream's contracts (each with its index in its file)."""
    by_name = {tool.name: tool for tool in listed}
    tool_list = list_digest(listed)
    verdicts = dict((id(contract), verdict) for contract, verdict in compare([c for _, c in contracts], listed))
    found = []
    for index, contract in contracts:
        now = by_name.get(contract.backend.tool or "")
        definition = definition_digest(now) if now is not None else UNREPRESENTABLE
        new = McpPin(definition, tool_list) if definition != UNREPRESENTABLE else None
        found.append(Repin(contract, index, new, verdicts.get(id(contract))))
    return found


def edit(text: str, repins: Sequence[Repin]) -> str:
    """``text`` (one registry file) with each entry's ``backend.pin`` set to its new pin."""
    root = yaml.compose(text)
    tools = _value(root, "tools")
    edits: list[tuple[int, int, str]] = []
    for repin in repins:
        if repin.new is None:
            continue
        backend = _value(tools.value[repin.index], "backend")
        pin = _value(backend, "pin")
        if pin is not None:
            for name in ("definition", "tool_list"):
                node = _value(pin, name)
                edits.append((node.start_mark.index, node.end_mark.index, f'"{getattr(repin.new, name)}"'))
            continue
        flow = f'{{definition: "{repin.new.definition}", tool_list: "{repin.new.tool_list}"}}'
        if backend.flow_style:
            close = text.rindex("}", backend.start_mark.index, backend.end_mark.index)
            edits.append((close, close, f", pin: {flow}"))
        else:
            first = backend.value[0][0].start_mark
            edits.append((first.index, first.index, f"pin: {flow}\n" + " " * first.column))
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _value(mapping: Any, key: str) -> Any:
    if not isinstance(mapping, yaml.MappingNode):
        return None
    for key_node, value_node in mapping.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


def write_validated(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` only if it loads as a valid registry file (atomically, same mode)."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        load_file(Path(temp))
        os.chmod(temp, path.stat().st_mode & 0o7777)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


async def repin(paths: Sequence[str], *, services: Mapping[str, str], mode: str, timeout_s: float,
                dry_run: bool, out: TextIO) -> int:
    """Re-pin every MCP contract of ``paths`` to its upstream's current tools; 0 when all went well."""
    by_url, status = _by_upstream(paths, services, out)
    repins, listed_status = await _plan_all(by_url, mode=mode, timeout_s=timeout_s, out=out)
    for path, found in repins.items():
        _write(path, found, dry_run=dry_run, out=out)
    return max(status, listed_status)


Entry = tuple[Path, int, ToolContract]


def _by_upstream(paths: Sequence[str], services: Mapping[str, str], out: TextIO) -> tuple[dict[str, list[Entry]], int]:
    """The MCP contracts of ``paths`` grouped by their upstream's URL (1: some could not be resolved)."""
    by_url: dict[str, list[Entry]] = {}
    status = 0
    for raw in paths:
        path = Path(raw)
        for index, contract in enumerate(load_file(path)):
            if contract.backend.type != "mcp":
                continue
            url = contract.backend.resolve(services)
            if url is None:
                print(f"{path}: {contract.name} {contract.version}: backend.service {contract.backend.service!r} "
                      f"is not in backends.services (pass --config); skipped", file=out)
                status = 1
                continue
            by_url.setdefault(url, []).append((path, index, contract))
    return by_url, status


async def _plan_all(by_url: Mapping[str, list[Entry]], *, mode: str, timeout_s: float,
                    out: TextIO) -> tuple[dict[Path, list[Repin]], int]:
    """Each upstream listed once; its contracts' new pins, per file (1: an upstream failed or dropped a tool)."""
    from .mcp_import import fetch_tools

    repins: dict[Path, list[Repin]] = {}
    status = 0
    for url, entries in by_url.items():
        try:
            listed = await fetch_tools(url, mode=mode, timeout_s=timeout_s)
        except Exception as exc:  # ExceptionGroup from the SDK's task groups included
            print(f"cannot list tools at {url}: {type(exc).__name__}; its {len(entries)} tool(s) left as they were",
                  file=out)
            status = 1
            continue
        for path, index, contract in entries:
            (found,) = plan([(index, contract)], listed)
            repins.setdefault(path, []).append(found)
            status = max(status, _report(found, out))
    return repins, status


def _write(path: Path, found: Sequence[Repin], *, dry_run: bool, out: TextIO) -> None:
    changed = [r for r in found if r.new is not None and r.new != r.contract.backend.pin]
    if changed and not dry_run:
        write_validated(path, edit(path.read_text(encoding="utf-8"), changed))
    print(f"{path}: {len(changed)} pin(s) {'to write (dry run)' if dry_run else 'written'}, "
          f"{sum(1 for r in found if r.new is not None and r.new == r.contract.backend.pin)} unchanged, "
          f"{sum(1 for r in found if r.new is None)} not listed upstream", file=out)


def _report(found: Repin, out: TextIO) -> int:
    contract = found.contract
    label = f"{contract.name} {contract.version} (upstream tool {contract.backend.tool!r})"
    if found.new is None:
        print(f"! {label}: the upstream no longer lists it; its pin is left as it was (retire or delete the "
              f"contract)", file=out)
        return 1
    if contract.backend.pin is None:
        print(f"+ {label}: pinned for the first time", file=out)
    elif found.drift is None:
        print(f"= {label}: matches its pins", file=out)
    else:
        print(f"~ {label}: {found.drift.summary()}", file=out)
        for line in found.drift.diff.split("\n"):
            print(f"    {line}", file=out)
        if found.drift.kind == "definition":
            print("    (the registry's description and schemas are not changed: edit them if the upstream's new "
                  "definition needs it)", file=out)
    return 0


def run(args: Any) -> int:
    import sys

    from ..config import ConfigError, load_config
    try:
        services = load_config(args.config).backends.services
        return asyncio.run(repin(args.paths, services=services, mode=args.mode, timeout_s=args.timeout,
                                 dry_run=args.dry_run, out=sys.stdout))
    except (ConfigError, RegistryError, OSError) as exc:
        print(f"toolproxy mcp repin: {exc}", file=sys.stderr)
        return 1
