"""Resolve stage: the trusted tool registry.

Owns: loading registry YAML files, validating them against
``schemas/tool-registry.schema.json`` and the strictness rule, and resolving
a (name, version) to a frozen ``ToolContract``: an explicit version that is
active or deprecated, or else the tool's default (its newest active version,
or its newest deprecated one when none is active); a retired version is
``tool_not_found`` with ``details.reason: retired``. ``LiveRegistry`` is the
one mutable handle: a reload swaps the whole contract set at once (calls
already running keep the frozen contract they resolved). Must never: take execution
metadata from anywhere but these files (not from tool descriptions, not from
upstream MCP annotations), or reach a backend.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import quote

import yaml

from . import approval_context, compensation_contract, output_filter, provenance, read_after_write
from .canonical_ids import CanonicalForm, FormError, form_from_registry
from .telemetry.record_view import EACH_VALUE_HIDDEN, RecordView, view_from_schema
from .approval_context import RelatedRead
from .wire import schema_fast
from .compensation_contract import CompensationSpec
from .read_after_write import VerifyRead
from .errors import ProxyError
from .output_filter import NO_POLICY, OutputPolicy
from .quota_rules import LimitSpec, spec_from_registry
from .wire.schema_fast import FastValidator

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
_PLACEHOLDER = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)\}")
KEY_PLACEHOLDER = "{key}"  # where a status endpoint wants the operation key
# A call with less budget left is not sent (DeadlineValid): even a nearby backend's answer rarely
# makes it back in under 100 ms over a real network, and a write sent anyway would become timeout_unknown
# through the proxy's own doing. Capped at the tool's timeout_ms; a contract may set its own.
DEFAULT_MIN_BUDGET_MS = 100


class RegistryError(Exception):
    """A registry file is invalid; the message names file, tool and JSON path."""


@cache
def load_schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class ResourceTemplate:
    template: str
    access: str  # shared | exclusive | none
    canonical: CanonicalForm | None = None  # applied to each placeholder's argument (normalize)

    @property
    def placeholders(self) -> tuple[str, ...]:
        return tuple(_PLACEHOLDER.findall(self.template))


@dataclass(frozen=True)
class Endpoint:
    url: str | None = None
    service: str | None = None
    path: str | None = None

    def resolve(self, services: Mapping[str, str]) -> str | None:
        if self.url:
            return self.url
        base = services.get(self.service or "")
        if base is None:
            return None
        return base.rstrip("/") + (self.path or "")

    def for_key(self, services: Mapping[str, str], key: str) -> str | None:
        """A status endpoint's URL for one operation key: the key where ``{key}`` stands (a path
        segment or a query parameter), else appended as the last path segment."""
        base = self.resolve(services)
        if base is None:
            return None
        safe_key = quote(key, safe="")
        return base.replace(KEY_PLACEHOLDER, safe_key) if KEY_PLACEHOLDER in base \
            else base.rstrip("/") + "/" + safe_key


@dataclass(frozen=True)
class McpPin:
    """An MCP tool's pins as reviewed (``backend.pin``): digests of the upstream's definition of the tool and
    of its tool list (proxy/drift.py); the live upstream is checked against them."""

    definition: str
    tool_list: str


@dataclass(frozen=True)
class Backend(Endpoint):
    type: str = "http"
    tool: str | None = None  # upstream tool name for type: mcp
    pin: McpPin | None = None  # type: mcp: what the upstream's tool was when reviewed (None: not checked)
    auth: str | None = None  # a credential of the config (``credentials.<name>``) attached to its requests


@dataclass(frozen=True)
class ToolContract:
    name: str
    version: str
    description: str
    mode: str
    risk: str
    input_schema: Mapping[str, Any]
    output_schema: Mapping[str, Any]
    backend: Backend
    resources: tuple[ResourceTemplate, ...] = ()
    # (argument, its canonical form) of the resource ids its templates declare one for (normalize applies them)
    canonical_ids: tuple[tuple[str, CanonicalForm], ...] = ()
    idempotency_required: bool = False
    idempotency_reason: str | None = None     # why a write runs without a key a retry reproduces (opt-out)
    idempotency_declared: bool = True         # False: ``required`` left to the default (start-up notice)
    retention_seconds: int = 86400
    timeout_ms: int = 10000
    min_budget_ms: int = DEFAULT_MIN_BUDGET_MS  # less budget left than this: not sent (timeout_not_started)
    service_lock: str = "none"  # a write's lock on its whole service: exclusive | shared | none (``Registry``)
    status_endpoint: Endpoint | None = None
    cancel_endpoint: Endpoint | None = None   # POSTed with the call's Idempotency-Key to cancel it (sent calls)
    compensation: CompensationSpec | None = None  # how a committed effect is compensated (docs/transactions.md)
    sensitive_fields: tuple[str, ...] = ()
    # What audit and decision records keep of the arguments (``_record_view``): what names a resource,
    # numbers, booleans, enums and ``safe_to_show`` in clear; every other value as its keyed fingerprint.
    record_view: RecordView = EACH_VALUE_HIDDEN
    approval_view: tuple[tuple[str, str, str], ...] = ()  # (argument, unit, currency): the console's view
    approver_may_read: tuple[str, ...] = ()   # sensitive fields an approver reads in clear (approval_context.py)
    related_read: RelatedRead | None = None   # the read shown beside a pending approval (approval_context.py)
    strict: bool = True
    status: str = "active"                    # active | deprecated | retired
    deprecated_at: str | None = None          # ISO date (RFC 9745 Deprecation)
    sunset: str | None = None                 # ISO date (RFC 8594 Sunset)
    replaced_by: str | None = None            # "2.0.0" (same tool) or "other_tool@1.0.0"
    source: str = ""
    quota: LimitSpec | None = None  # the tool's own limit (counted per tool name, across tenants)
    output_policy: OutputPolicy = NO_POLICY  # what of a result the model sees (proxy/output_filter.py)
    visible_output_schema: Mapping[str, Any] = field(default_factory=dict)  # its advertised shape
    state_guard: str | None = None  # the argument carrying the expected state, forwarded as If-Match
    service_wide_reason: str | None = None  # why a write declares no resources (else check-registry refuses it)
    verify_read: VerifyRead | None = None  # the read that checks a committed write (proxy/read_after_write.py)
    # the read of the guarded state under the write's lock, right before sending (expect: its pointer -> the
    # guard argument); None: only the backend checks the state (If-Match)
    state_read: VerifyRead | None = None
    # a state_guard without an argument: the pointer into state_read's result to the state captured when the
    # call is decided and compared under the lock (``state_if_match``: it is the backend's entity tag, sent as
    # If-Match); "" with an argument, which states the expected state itself
    state_at: str = ""
    state_if_match: bool = False
    ownership_read: VerifyRead | None = None  # the owning tenant's read at the call (``owner_at``: where it is)
    owner_at: str = ""  # ownership_read's pointer into the read's result: the owning tenant
    flow_produces: tuple[str, ...] = ()  # labels its output brings into the agent's context (proxy/flow.py)
    flow_sink: str = "internal"          # where its arguments go: internal | external
    flow_sink_arguments: tuple[str, ...] = ()  # JSON pointers of the arguments that aim the call (provenance.py)
    flow_integrity: str | None = None    # destructive | state_changing: a target must not come from untrusted output
    flow_trusted_source: bool = False    # its output is the user's own records: values seen in it are trusted
    flow_payload_arguments: tuple[str, ...] = ()  # JSON pointers of the free text it carries (provenance.py)
    # where its output lists the organisation's existing members or objects: ("",) the whole output, or the
    # pointers of the fields the platform sets to one (a message's sender); () none
    flow_directory: tuple[str, ...] = ()
    input_validator: FastValidator = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    output_validator: FastValidator = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    @property
    def is_write(self) -> bool:
        return self.mode == "write"

    @property
    def keyless_write(self) -> bool:
        """A write whose contract opted out of the key requirement (with its stated reason)."""
        return self.is_write and not self.idempotency_required

    @property
    def service_wide(self) -> bool:
        """A write that declares no lockable resource: it conflicts with every write of its service ("when
        in doubt, no parallelism"), as if it wrote the whole service."""
        return self.is_write and not any(r.access in ("shared", "exclusive") for r in self.resources)

    @property
    def declares_output(self) -> bool:
        """Whether the contract declares an outputSchema (verified on every result when it does)."""
        return bool(self.output_schema)

    @property
    def callable(self) -> bool:
        return self.status != "retired"

    def flow_facts(self) -> dict[str, Any]:
        """The contract's flow facts as the policy sees them (``input.tool.flow``, the catalog)."""
        facts: dict[str, Any] = {"produces": list(self.flow_produces), "sink": self.flow_sink,
                                 "sink_arguments": list(self.flow_sink_arguments),
                                 "trusted_source": self.flow_trusted_source}
        if self.flow_payload_arguments:
            facts["payload_arguments"] = list(self.flow_payload_arguments)
        if self.flow_directory:
            facts["directory"] = self.flow_directory == ("",) or list(self.flow_directory)
        if self.flow_integrity is not None:
            facts["integrity"] = self.flow_integrity
        return facts

    @property
    def records_provenance(self) -> bool:
        """Whether a call's output is fingerprinted (proxy/provenance.py): untrusted, the user's records, or a
        directory of the organisation's members or objects."""
        return self.flow_trusted_source or self.flow_directory or "untrusted" in self.flow_produces

    @property
    def looks_up_provenance(self) -> bool:
        """Whether a call's arguments are looked up (proxy/provenance.py): it names sink or payload arguments."""
        return bool(self.flow_sink_arguments or self.flow_payload_arguments)

    @property
    def backend_name(self) -> str:
        """The backend service this tool counts against (breaker, back-pressure, backend limits). A tool
        with a ``url:`` backend is a service of its own, named after the tool (addresses are never names)."""
        return self.backend.service or f"tool.{self.name}"

    def summary(self) -> dict[str, Any]:
        """What policies and listings may know about the tool (trusted facts only)."""
        return {
            "name": self.name,
            "version": self.version,
            "mode": self.mode,
            "risk": self.risk,
            "resources": [r.template for r in self.resources],
            "idempotency_required": self.idempotency_required,
        }

    def listing(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "description": self.description,
            "inputSchema": thaw(self.input_schema),
            **({"outputSchema": thaw(self.visible_output_schema)} if self.declares_output else {}),
            "timeout_ms": self.timeout_ms,
        }


@dataclass(frozen=True)
class ServicePolicy:
    """A backend service's registry defaults: its limit and its breaker settings (None: the config's)."""

    quota: LimitSpec | None = None
    breaker: Mapping[str, Any] = field(default_factory=dict)  # enabled, failure_ratio, min_calls, window_s, open_s


class Registry:
    """An immutable set of tool contracts, keyed by name then version, and the backend services' defaults."""

    def __init__(self, tools: Iterable[ToolContract], services: Mapping[str, ServicePolicy] | None = None) -> None:
        self.services: Mapping[str, ServicePolicy] = MappingProxyType(dict(services or {}))
        by_name: dict[str, dict[str, ToolContract]] = {}
        for tool in _with_service_locks(list(tools)):
            versions = by_name.setdefault(tool.name, {})
            if tool.version in versions:
                raise RegistryError(
                    f"{tool.source}: tool {tool.name!r} version {tool.version} is also defined in "
                    f"{versions[tool.version].source}")
            versions[tool.version] = tool
        for versions in by_name.values():
            for tool in versions.values():
                _check_successor(tool, by_name)
                _check_compensation(tool, by_name)
                _check_related_read(tool, by_name)
                _check_verify_read(tool, by_name)
                _check_state_read(tool, by_name)
                _check_read_before_send(tool, by_name, tool.ownership_read, "ownership_read")
        self._tools = MappingProxyType({k: MappingProxyType(v) for k, v in by_name.items()})
        self._defaults = _defaults(self._tools)
        # Files contracts name beside the registry files (alias tables): a change to one reloads the registry.
        self.named_files: tuple[str, ...] = tuple(sorted({
            form.aliases_file for versions in by_name.values() for tool in versions.values()
            for _, form in tool.canonical_ids if form.aliases_file}))

    def __len__(self) -> int:
        return sum(len(v) for v in self._tools.values())

    def active(self) -> list[ToolContract]:
        """The default version of every callable tool, sorted by name (deterministic listings)."""
        return [tool for tool in (self.default(name) for name in sorted(self._tools)) if tool is not None]

    def all(self) -> list[ToolContract]:
        return [t for name in sorted(self._tools) for t in
                sorted(self._tools[name].values(), key=lambda t: _version_key(t.version))]

    def default(self, name: str) -> ToolContract | None:
        """What a call without a version gets: the newest active version, else the newest deprecated one
        (found once per tool set, not per call)."""
        return self._defaults.get(name)

    def get(self, name: str, version: str) -> ToolContract | None:
        """The exact contract, whatever its status (records name their exact contract)."""
        return self._tools.get(name, {}).get(version)

    def resolve(self, name: Any, version: Any = None) -> ToolContract:
        if not isinstance(name, str) or name not in self._tools:
            raise ProxyError("tool_not_found", "The requested tool does not exist.",
                             details={"tool": name if isinstance(name, str) else None}, phase="resolve")
        if version is None:
            tool = self.default(name)
            if tool is None:
                raise ProxyError("tool_not_found", "The requested tool is retired.",
                                 details={"tool": name, "reason": "retired"}, phase="resolve")
            return tool
        tool = self._tools[name].get(version) if isinstance(version, str) else None
        if tool is None:
            raise ProxyError("tool_not_found", "The requested tool version does not exist.",
                             details={"tool": name, "version": version if isinstance(version, str) else None},
                             phase="resolve")
        if not tool.callable:
            raise retired_error(tool)
        return tool


def _with_service_locks(tools: list[ToolContract]) -> list[ToolContract]:
    """Each write's ``service_lock``: a write that declares no resources locks its whole service exclusively
    (when in doubt, no parallelism), so every other write of a service that has such a write
    takes that service lock shared. Services without one pay nothing."""
    wide = {t.backend_name for t in tools if t.service_wide}
    return [replace(t, service_lock="exclusive" if t.service_wide else "shared")
            if t.is_write and t.backend_name in wide else t for t in tools]


def unmapped_services(registry: Registry, services: Mapping[str, str]) -> list[str]:
    """Every place a contract names a backend service that ``backends.services`` does not map, one line each
    naming the file, the tool, the service and the fix. Such a call could only fail (as a retryable
    ``dependency_unavailable``, telling the model to retry a configuration error), so the registry is refused
    at start-up and at reload instead."""
    problems = []
    for tool in registry.all():
        places = [("backend", tool.backend), ("status_endpoint", tool.status_endpoint),
                  ("cancel_endpoint", tool.cancel_endpoint)]
        for where, endpoint in places:
            name = endpoint.service if endpoint is not None and not endpoint.url else None
            if name is None or name in services:
                continue
            import difflib  # only when a name is wrong: a correct start never imports it

            near = difflib.get_close_matches(name, list(services), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            mapped = ", ".join(sorted(services)) or "none"
            problems.append(f"{tool.source}: tool {tool.name} {tool.version}: {where} service {name} is not in "
                            f"backends.services (mapped: {mapped}): {hint}fix the name or map the service in "
                            f"backends.services (TOOLPROXY_BACKENDS_SERVICES)")
    return problems


def service_resource(tool: ToolContract) -> str:
    """The lock resource id standing for a write's whole service (``@`` never starts a template's id)."""
    return f"@service:{tool.backend_name}"


def _defaults(tools: Mapping[str, Mapping[str, ToolContract]]) -> Mapping[str, ToolContract]:
    """Per tool name, the newest active version, else the newest deprecated one (none: retired)."""
    found: dict[str, ToolContract] = {}
    for name, versions in tools.items():
        for status in ("active", "deprecated"):
            live = [t for t in versions.values() if t.status == status]
            if live:
                found[name] = max(live, key=lambda t: _version_key(t.version))
                break
    return MappingProxyType(found)


def retired_error(tool: ToolContract) -> ProxyError:
    """A retired version: ``tool_not_found`` with the reason and the successor, so a caller can re-plan."""
    return ProxyError("tool_not_found", "The requested tool version is retired; re-plan with its successor.",
                      details={"tool": tool.name, "version": tool.version, "reason": "retired",
                               "replaced_by": tool.replaced_by}, phase="resolve")


class LiveRegistry(Registry):
    """The registry a running proxy serves: the same reads, and ``swap`` for a validated reload."""

    def __init__(self, registry: Registry) -> None:
        self._tools, self._defaults = registry._tools, registry._defaults
        self.services = registry.services
        self.named_files = registry.named_files

    def swap(self, registry: Registry) -> None:
        # A call sees the old tool set or the new one, never a mix; the services' defaults follow.
        self._tools, self._defaults = registry._tools, registry._defaults
        self.services = registry.services
        self.named_files = registry.named_files


def notices(registry: Registry) -> list[tuple[str, str]]:
    """What a registry relies on that an operator should know, as (level, line): writes that left the key
    requirement to the default (they require a key), writes that opted out (with
    their reason), and writes without resources (serialized with every write of their service, and frozen with
    it by an unknown outcome: ``SERVICE_WIDE`` without a stated reason). Logged at start-up and printed by
    ``check-registry``."""
    found: list[tuple[str, str]] = []
    for tool in registry.all():
        if not tool.callable or not tool.is_write:
            continue
        label = f"{tool.name} {tool.version} ({tool.source})"
        if not tool.idempotency_declared:
            found.append(("warning", f"{label}: a write requires a key a retry reproduces (idempotency.required "
                                     f"defaults to true for writes): callers send an Idempotency-Key or X-Run-Id, "
                                     f"else the call is refused with idempotency_key_required. Say so to silence "
                                     f"this (idempotency: {{required: true}}), or state why it may run keyless: "
                                     f"idempotency: {{required: false, reason: ...}}"))
        if tool.keyless_write:
            found.append(("opt-out", f"{label}: runs without a key a retry reproduces: {tool.idempotency_reason}"))
        if tool.service_wide and tool.service_wide_reason:
            found.append(("opt-out", f"{label}: declares no resources, so it locks and an unknown outcome of it "
                                     f"freezes all of service {tool.backend_name}: {tool.service_wide_reason}"))
        elif tool.service_wide:
            found.append((SERVICE_WIDE, f"{label}: a write that declares no resources conflicts with every write "
                                        f"of service {tool.backend_name}: it never runs beside them, and one "
                                        f"unknown outcome of it freezes every write there until an operator "
                                        f"resolves it (declare the resources it writes, or state why it has none: "
                                        f"service_wide_reason: ...)"))
    return found


# The level of a write without resources that states no reason: a warning at start-up and for a development
# registry (``check-registry --dev``), an error for the registry ``check-registry`` vets for production.
SERVICE_WIDE = "service-wide"


def _check_successor(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]]) -> None:
    if tool.replaced_by is None:
        return
    name, _, version = tool.replaced_by.rpartition("@")
    _other_callable(tool, by_name, name or tool.name, version,
                    f"{tool.source}: tool {tool.name!r} version {tool.version}: replaced_by {tool.replaced_by!r}")


def _other_callable(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]], name: str, version: str,
                    where: str) -> ToolContract:
    """The contract ``name@version`` that ``tool`` refers to; it must be another callable one."""
    target = by_name.get(name, {}).get(version)
    if target is None or not target.callable or target is tool:
        raise RegistryError(f"{where} is not another callable contract of this registry")
    return target


def _check_compensation(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]]) -> None:
    spec = tool.compensation
    if spec is None:
        return
    where = f"{tool.source}: tool {tool.name!r} version {tool.version}: compensation"
    target = _other_callable(tool, by_name, spec.tool, spec.version, f"{where}: {spec.tool}@{spec.version}")
    if target.compensation is not None:
        raise RegistryError(f"{where}: {spec.tool}@{spec.version} declares a compensation of its own "
                            f"(a compensation is never compensated again)")
    found = compensation_contract.problems(spec, original_input=tool.input_schema,
                                           original_output=tool.output_schema,
                                           original_retention_s=tool.retention_seconds,
                                           target_input=target.input_schema)
    if found:
        raise RegistryError(f"{where}: {found[0]}")


def _check_related_read(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]]) -> None:
    read = tool.related_read
    if read is None or not tool.callable:  # a retired contract has no approvals to show a read beside
        return
    where = f"{tool.source}: tool {tool.name!r} version {tool.version}: related_read"
    target = _other_callable(tool, by_name, read.tool, read.version, f"{where}: {read.tool}@{read.version}")
    found = approval_context.related_problems(read, request_input=tool.input_schema,
                                              sensitive_fields=tool.sensitive_fields, target_mode=target.mode,
                                              target_input=target.input_schema, target_sink=target.flow_sink,
                                              target_risk=target.risk)
    if found:
        raise RegistryError(f"{where}: {found[0]}")


def _check_verify_read(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]]) -> None:
    read = tool.verify_read
    if read is None or not tool.callable:
        return
    where = f"{tool.source}: tool {tool.name!r} version {tool.version}: verify_read"
    if not tool.is_write:
        raise RegistryError(f"{where}: only a write's commit is checked")
    target = _other_callable(tool, by_name, read.tool, read.version, f"{where}: {read.tool}@{read.version}")
    found = read_after_write.problems(read, write_input=tool.input_schema, write_output=tool.output_schema,
                                      target_mode=target.mode, target_input=target.input_schema)
    if found:
        raise RegistryError(f"{where}: {found[0]}")


def _check_state_read(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]]) -> None:
    _check_read_before_send(tool, by_name, tool.state_read, "state_guard.read")


def _check_read_before_send(tool: ToolContract, by_name: Mapping[str, Mapping[str, ToolContract]],
                            read: VerifyRead | None, label: str) -> None:
    """A read the proxy runs right before sending (the guarded state, the owning tenant): a read tool of this
    registry whose arguments come from the call's own arguments (nothing has a result yet)."""
    if read is None or not tool.callable:
        return
    where = f"{tool.source}: tool {tool.name!r} version {tool.version}: {label}"
    target = _other_callable(tool, by_name, read.tool, read.version, f"{where}: {read.tool}@{read.version}")
    found = read_after_write.problems(read, write_input=tool.input_schema, write_output={"type": "object"},
                                      target_mode=target.mode, target_input=target.input_schema)
    found += [f"arguments: {p} is not one of the write's arguments (the state is read before the write)"
              for p in (s.pointer for s in read.arguments.values()) if p and not p.startswith("/arguments/")]
    if found:
        raise RegistryError(f"{where}: {found[0]}")


def unchecked_state(registry: "Registry") -> list[str]:
    """Writes on exclusively locked resources whose state nothing checks at the write (no ``state_guard``):
    a resource that changed hands or state between the decision and the write is written anyway, unless the
    backend checks it itself. ``check-registry`` warns about each."""
    return [f"{tool.name} {tool.version} ({tool.source}): its resources' state is not checked at the write: "
            f"declare state_guard (a read of the state the proxy captures at the decision and compares under the "
            f"lock right before sending, or an argument the backend honours as If-Match, or both) unless the "
            f"backend checks ownership and state itself"
            for tool in registry.all() if tool.callable and tool.is_write and tool.state_guard is None
            and tool.state_read is None
            and any(r.access == "exclusive" for r in tool.resources)]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def registry_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml"}))
        elif path.exists():
            files.append(path)
        else:
            raise RegistryError(f"{path}: no such registry file or directory")
    if not files:
        raise RegistryError(f"no registry files found in {', '.join(map(str, paths))}")
    return files


def load_registry(paths: Iterable[str | Path]) -> Registry:
    """Load and validate every registry file; raise RegistryError on the first bad one."""
    tools: list[ToolContract] = []
    services: dict[str, ServicePolicy] = {}
    for path in registry_files(paths):
        document = _parse(path)  # once per file: PyYAML is most of a start-up's registry time
        tools.extend(_tools(path, document))
        for name, policy in _services(document).items():
            if name in services:
                raise RegistryError(f"{path}: service {name!r} is also described in another registry file")
            services[name] = policy
    return Registry(tools, services)


# libyaml's parser where PyYAML was built with it (the same safe constructors and resolvers, several times
# faster than the pure-Python one); the pure-Python one otherwise.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_services(path: Path) -> dict[str, ServicePolicy]:
    """The file's ``services:`` section (backend defaults); the file was validated by ``load_file``."""
    return _services(_parse(path))


def _services(document: Any) -> dict[str, ServicePolicy]:
    document = document or {}
    return {name: ServicePolicy(quota=spec_from_registry(raw["quotas"]) if raw.get("quotas") else None,
                                breaker=MappingProxyType(dict(raw.get("breaker") or {})))
            for name, raw in (document.get("services") or {}).items()}


def load_file(path: Path) -> list[ToolContract]:
    return _tools(path, _parse(path))


def _parse(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as handle:  # a stream: the parser's marks name the file, not a string
            return yaml.load(handle, Loader=_YAML_LOADER)  # noqa: S506 (a safe loader)
    except (OSError, yaml.YAMLError) as exc:
        raise RegistryError(f"{path}: cannot parse YAML: {' '.join(str(exc).split())}") from None


def _tools(path: Path, document: Any) -> list[ToolContract]:
    """The file's contracts, the document validated against the registry schema first."""
    _dates_as_text(document)
    errors = sorted(_file_validator().iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        first = errors[0]
        raise RegistryError(f"{path}: {_tool_label(document, first.absolute_path)}at {_json_path(first.absolute_path)}: "
                            f"{first.message}")
    return [_contract(path, index, raw) for index, raw in enumerate(document["tools"])]


@cache
def _file_validator() -> FastValidator:
    """The registry file schema's validator (a valid file is not walked again in Python)."""
    return schema_fast.validator(load_schema("tool-registry.schema.json"))


def _dates_as_text(document: Any) -> None:
    """YAML reads an unquoted 2027-03-31 as a date; the schema (and JSON) want the ISO text."""
    tools = document.get("tools") if isinstance(document, dict) else None
    for raw in tools if isinstance(tools, list) else ():
        if isinstance(raw, dict):
            for name in ("sunset", "deprecated_at"):
                if isinstance(raw.get(name), (datetime.date, datetime.datetime)):
                    raw[name] = raw[name].isoformat()[:10]


def _tool_label(document: Any, path: Iterable[Any]) -> str:
    parts = list(path)
    if len(parts) >= 2 and parts[0] == "tools" and isinstance(parts[1], int):
        try:
            return f"tool {document['tools'][parts[1]].get('name', '#' + str(parts[1]))} "
        except (AttributeError, IndexError, KeyError, TypeError):
            pass
    return ""


def _json_path(parts: Iterable[Any]) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _contract(path: Path, index: int, raw: dict[str, Any]) -> ToolContract:
    """One tool entry, checked (each family of checks below names the entry's JSON path) and frozen."""
    name = raw["name"]
    at = _At(f"{path}: tool {name}", f"$.tools[{index}]", path.parent)
    strict = raw.get("strict", True)
    output_schema = raw.get("outputSchema") or {}
    _check_schemas(at, raw, strict)
    resources = _resources(at, raw)
    output_policy = output_filter.policy_from_registry(raw.get("output_filter"), raw.get("output_limit"))
    _check_filter_guard_readable(at, raw, output_policy)
    output_policy = output_filter.with_defaults(  # only declared fields, nothing sensitive (checked: from the schema)
        output_policy, output_schema, tuple(raw.get("sensitive_fields", ())),
        declared_only=(raw.get("output_filter") or {}).get("declared_only", True))
    guard = raw.get("state_guard")
    idem, required = _idempotency(at, raw)
    timeout_ms, min_budget_ms = _budget(at, raw)
    status = raw.get("status_endpoint")
    cancel = raw.get("cancel_endpoint")
    return ToolContract(
        name=name,
        version=raw["version"],
        description=raw["description"],
        mode=raw["mode"],
        risk=raw["risk"],
        input_schema=_freeze(raw["inputSchema"]),
        output_schema=_freeze(output_schema),
        backend=_backend(raw["backend"]),
        resources=tuple(resources),
        canonical_ids=tuple({name: r.canonical for r in resources if r.canonical is not None
                             for name in r.placeholders}.items()),
        idempotency_required=required,
        idempotency_reason=idem.get("reason"),
        idempotency_declared="required" in idem,
        retention_seconds=idem.get("retention_seconds", 86400),
        timeout_ms=timeout_ms,
        min_budget_ms=min_budget_ms,
        status_endpoint=_endpoint(status),
        cancel_endpoint=_endpoint(cancel),
        compensation=compensation_contract.spec_from_registry(raw["compensation"]) if raw.get("compensation")
        else None,
        sensitive_fields=tuple(raw.get("sensitive_fields", [])),
        record_view=_record_view(at, raw, resources),
        approval_view=tuple((name, view["unit"], view["currency"])
                            for name, view in sorted((raw.get("approval_view") or {}).items())),
        approver_may_read=tuple(raw.get("approver_may_read", [])),
        related_read=approval_context.related_from_registry(raw.get("related_read")),
        strict=strict,
        status=raw.get("status", "active"),
        deprecated_at=raw.get("deprecated_at"),
        sunset=raw.get("sunset"),
        replaced_by=raw.get("replaced_by"),
        source=str(path),
        quota=spec_from_registry(raw["quotas"]) if raw.get("quotas") else None,
        output_policy=output_policy,
        visible_output_schema=_freeze(output_filter.visible_schema(output_policy, output_schema)),
        state_guard=(guard or {}).get("argument"),
        service_wide_reason=raw.get("service_wide_reason"),
        verify_read=read_after_write.from_registry(raw.get("verify_read")),
        state_read=_state_read(guard),
        state_at=_captured_state_at(guard),
        state_if_match=bool((guard or {}).get("if_match")),
        **_ownership_fields(raw),
        **_flow_fields(raw),
        input_validator=schema_fast.validator(raw["inputSchema"], formats=True),
        output_validator=schema_fast.validator(output_schema, formats=True),
    )


def _ownership_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A contract's ``ownership_read`` entry as the contract's fields: the read, and where its answer names the
    owning tenant."""
    return {"ownership_read": read_after_write.from_registry({**raw["ownership_read"], "expect": {}})
            if raw.get("ownership_read") else None,
            "owner_at": (raw.get("ownership_read") or {}).get("tenant", "")}


def _flow_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A contract's ``flow`` labels as the contract's fields (absent: produces nothing, an internal sink)."""
    flow = raw.get("flow") or {}
    return {"flow_produces": tuple(sorted(flow.get("produces", ()))),
            "flow_sink": flow.get("sink", "internal"),
            "flow_sink_arguments": tuple(provenance.pointer(p) for p in flow.get("sink_arguments", ())),
            "flow_integrity": flow.get("integrity"),
            "flow_trusted_source": bool(flow.get("trusted_source", False)),
            "flow_payload_arguments": tuple(provenance.pointer(p) for p in flow.get("payload_arguments", ())),
            "flow_directory": _directory(flow.get("directory", False))}


def _directory(raw: Any) -> tuple[str, ...]:
    """``flow.directory``: true (the whole output), false, or the fields listing existing members."""
    if raw is True:
        return ("",)
    return tuple(provenance.pointer(p) for p in raw) if isinstance(raw, list) else ()


def _backend(raw: Mapping[str, Any]) -> Backend:
    """A contract's ``backend`` entry (checked by the registry's schema) as its value."""
    return Backend(type=raw["type"], url=raw.get("url"), service=raw.get("service"), path=raw.get("path"),
                   tool=raw.get("tool"), pin=McpPin(**raw["pin"]) if raw.get("pin") else None, auth=raw.get("auth"))


def _check_filter_guard_readable(at: "_At", raw: Mapping[str, Any], output_policy: Any) -> None:
    """The output filter against the output schema, the state guard's argument, the approver-readable fields."""
    found = output_filter.problems(output_policy, raw.get("outputSchema") or {})
    if found:
        raise at.error("output_filter", found[0])
    _check_state_guard(at, raw)
    flow = raw.get("flow") or {}
    for name in ("sink_arguments", "payload_arguments"):
        for index, path in enumerate(flow.get(name, ())):
            problem = provenance.schema_problem(path, raw["inputSchema"])
            if problem:
                raise at.error(f"flow.{name}[{index}]", problem)
    if flow.get("trusted_source") and "untrusted" in flow.get("produces", ()):
        raise at.error("flow.trusted_source", "a tool whose output is untrusted cannot be a trusted source "
                       "(drop one of them)")
    if flow.get("integrity") and not flow.get("sink_arguments"):
        raise at.error("flow.integrity", "names no target: list the arguments that aim the write in "
                       "flow.sink_arguments")
    readable = approval_context.readable_problems(raw.get("approver_may_read", []), raw.get("sensitive_fields", []))
    if readable:
        raise at.error("approver_may_read" + readable[0].partition(":")[0], readable[0].partition(": ")[2])


def _check_state_guard(at: "_At", raw: Mapping[str, Any]) -> None:
    """A guard argument is a required argument; a captured state sent as If-Match needs a read to capture it
    and an HTTP backend to send it to (with an argument, the argument is what If-Match carries)."""
    guard = raw.get("state_guard")
    if guard is None:
        return
    argument = guard.get("argument")
    if argument is not None and argument not in (raw["inputSchema"].get("required") or []):
        raise at.error("state_guard.argument", f"{argument!r} is not a required property of inputSchema")
    if guard.get("if_match") and (argument is not None or not guard.get("read")):
        raise at.error("state_guard.if_match", "only a guard without an argument sends the state its read "
                       "captured as If-Match (a guard argument is sent as If-Match already)")
    if guard.get("if_match") and raw["backend"]["type"] != "http":
        raise at.error("state_guard.if_match", "If-Match is an HTTP header: only an http backend receives it")


def _captured_state_at(guard: Mapping[str, Any] | None) -> str:
    """A guard without an argument: where its read's result holds the state captured at the decision."""
    return guard["read"]["state"] if guard and guard.get("read") and "argument" not in guard else ""


def _state_read(guard: Mapping[str, Any] | None) -> VerifyRead | None:
    """The read of a guarded state: compared with the guard argument, or (without one) with what the same
    read gave when the call was decided (no ``expect``)."""
    if not guard or not guard.get("read"):
        return None
    read = guard["read"]
    expect = {read["state"]: f"/arguments/{guard['argument']}"} if "argument" in guard else {}
    return read_after_write.from_registry({**read, "expect": expect})


@dataclass(frozen=True)
class _At:
    """Where a tool entry is: its file and name, and its JSON path in the file (for one-line errors)."""

    where: str
    path: str
    base_dir: Path = Path(".")  # the registry file's folder (files a contract names are relative to it)

    def error(self, field_path: str, what: str) -> RegistryError:
        return RegistryError(f"{self.where} at {self.path}.{field_path}: {what}")


def _check_schemas(at: _At, raw: dict[str, Any], strict: bool) -> None:
    output_schema = raw.get("outputSchema")
    for label, schema in (("inputSchema", raw["inputSchema"]), ("outputSchema", output_schema or {})):
        try:
            schema_fast.check_schema(schema)
        except Exception as exc:  # jsonschema.SchemaError
            raise at.error(label, f"not a valid JSON Schema: {getattr(exc, 'message', exc)}") from None
    if output_schema is not None and output_schema.get("type") != "object":
        # MCP revisions up to 2025-11-25 can only carry an object outputSchema (and its
        # structuredContent); a schema without constraints promises nothing in any revision.
        raise at.error("outputSchema", "must declare type: object "
                       "(omit outputSchema when the tool's output has no declared shape)")
    for label, schema in (("inputSchema", raw["inputSchema"]), ("outputSchema", output_schema or {})):
        unsatisfiable = _unsatisfiable_required(schema, f"{at.path}.{label}")
        if unsatisfiable:
            where, name = unsatisfiable[0]
            never = "no call can satisfy it" if label == "inputSchema" else "no answer can satisfy it"
            raise RegistryError(f"{at.where} at {where}.required: {name} is required but not in properties, and "
                                f"additionalProperties is false: {never} (add it to properties, or drop it "
                                f"from required)")
    if strict:
        loose = _loose_objects(raw["inputSchema"], f"{at.path}.inputSchema")
        if loose:
            raise RegistryError(f"{at.where} at {loose[0]}: object schema without additionalProperties: false "
                                f"(set strict: false on the tool to allow it)")


def _resources(at: _At, raw: dict[str, Any]) -> list[ResourceTemplate]:
    properties = set((raw["inputSchema"].get("properties") or {}).keys())
    resources = []
    forms: dict[str, CanonicalForm | None] = {}  # one argument, one canonical form across templates
    for r_index, res in enumerate(raw.get("resources", [])):
        template = ResourceTemplate(res["template"], res.get("access") or
                                    ("exclusive" if raw["mode"] == "write" else "none"),
                                    _canonical_form(at, f"resources[{r_index}].canonical", res.get("canonical")))
        missing = [p for p in template.placeholders if p not in properties]
        if missing:
            raise at.error(f"resources[{r_index}].template",
                           f"placeholder {missing[0]!r} is not a property of inputSchema")
        for name in template.placeholders:
            if forms.setdefault(name, template.canonical) != template.canonical:
                raise at.error(f"resources[{r_index}].canonical", f"argument {name!r} has another canonical "
                               "form in an earlier template (one argument names one object: give it one form)")
        resources.append(template)
    return resources


def _record_view(at: _At, raw: Mapping[str, Any], resources: list[ResourceTemplate]) -> RecordView:
    """What audit and decision records keep of a call's arguments (proxy/telemetry/record_view.py): in clear
    what names a resource (a template placeholder), numbers, booleans, ``enum`` / ``const`` values and the
    paths the contract lists in ``safe_to_show``; every other value, and each of ``sensitive_fields``, as its
    keyed fingerprint (a security code in an e-mail body must not sit in a decision record)."""
    sensitive = list(raw.get("sensitive_fields", []))
    safe = list(raw.get("safe_to_show", []))
    for path in safe:
        problem = provenance.schema_problem("/" + path.replace(".", "/"), raw["inputSchema"])
        if problem:
            raise at.error("safe_to_show", problem)
        if path in sensitive:
            raise at.error("safe_to_show", f"{path!r} is in sensitive_fields: it cannot also be safe to show")
    placeholders = sorted({p for r in resources for p in r.placeholders})
    return view_from_schema(raw["inputSchema"], shown=[*placeholders, *safe], hidden=sensitive)


def _canonical_form(at: _At, where: str, raw: Mapping[str, Any] | None) -> CanonicalForm | None:
    try:
        return form_from_registry(raw, at.base_dir)
    except FormError as exc:
        raise at.error(f"{where}.{exc.where}", str(exc)) from None


def _idempotency(at: _At, raw: dict[str, Any]) -> tuple[Mapping[str, Any], bool]:
    """The entry's idempotency block and whether a key is required (a write's opt-out needs a reason)."""
    idem = raw.get("idempotency", {})
    required = idem.get("required", raw["mode"] == "write")
    if raw["mode"] == "write" and not required and not idem.get("reason"):
        raise at.error("idempotency", "a write opts out of the key requirement only with a stated reason "
                       "(idempotency: {required: false, reason: ...}); without a key a retry after an unknown "
                       "outcome repeats the effect")
    return idem, required


def _budget(at: _At, raw: dict[str, Any]) -> tuple[int, int]:
    """(timeout_ms, min_budget_ms): below the second a call is not started."""
    timeout_ms = raw.get("timeout_ms", 10000)
    min_budget_ms = raw.get("min_budget_ms", min(DEFAULT_MIN_BUDGET_MS, timeout_ms))
    if min_budget_ms > timeout_ms:
        raise at.error("min_budget_ms", f"{min_budget_ms} exceeds timeout_ms {timeout_ms} "
                       "(no call could ever be sent)")
    return timeout_ms, min_budget_ms


def _endpoint(spec: Mapping[str, Any] | None) -> "Endpoint | None":
    return Endpoint(url=spec.get("url"), service=spec.get("service"), path=spec.get("path")) if spec else None


_NAMED_SUBSCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_ONE_SUBSCHEMA = {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems"}
_LISTED_SUBSCHEMAS = {"allOf", "anyOf", "oneOf", "prefixItems"}


def _loose_objects(schema: Any, where: str) -> list[str]:
    """JSON paths of object subschemas that allow unknown properties."""
    if not isinstance(schema, dict):
        return []
    types_ = schema.get("type")
    is_object = types_ == "object" or (isinstance(types_, list) and "object" in types_) or "properties" in schema
    loose = is_object and schema.get("additionalProperties") is not False \
        and schema.get("unevaluatedProperties") is not False
    found = [where] if loose else []
    for path, sub in _subschemas(schema, where):
        found.extend(_loose_objects(sub, path))
    return found


def _unsatisfiable_required(schema: Any, where: str) -> list[tuple[str, str]]:
    """(path, name) of each required name an object schema refuses as an unknown property: not in its
    ``properties`` nor matched by its ``patternProperties``, with ``additionalProperties: false``."""
    if not isinstance(schema, dict):
        return []
    found = []
    if schema.get("additionalProperties") is False and isinstance(schema.get("required"), list):
        # additionalProperties looks only at its own schema's properties and patternProperties
        declared = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        for name in schema["required"]:
            if isinstance(name, str) and name not in declared and not any(re.search(p, name) for p in patterns):
                import difflib  # only for a schema that is wrong

                near = difflib.get_close_matches(name, list(declared), n=1)
                found.append((where, f"{name} (did you mean {near[0]}?)" if near else name))
    for path, sub in _subschemas(schema, where):
        found.extend(_unsatisfiable_required(sub, path))
    return found


def _subschemas(schema: dict[str, Any], where: str) -> Iterator[tuple[str, Any]]:
    """Every (path, subschema) directly below a schema node."""
    for key, value in schema.items():
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            yield from ((f"{where}.{key}.{name}", sub) for name, sub in value.items())
        elif key in _ONE_SUBSCHEMA:
            yield f"{where}.{key}", value
        elif key in _LISTED_SUBSCHEMAS and isinstance(value, list):
            yield from ((f"{where}.{key}[{i}]", sub) for i, sub in enumerate(value))
