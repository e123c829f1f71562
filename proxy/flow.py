"""Flow stage: which data-flow labels an agent's context holds, for the policy (``input.flow``).

A contract declares ``flow.produces`` (labels its output brings into the agent's context: private,
untrusted, secret) and ``flow.sink`` (internal, or external: its arguments leave the company). Each
call that returns output of a labelled tool records, per (label, tool), the time it did, in two Redis
hashes under the tenant's hash tag (one Cluster slot):

- the principal scope ``<prefix>:flow:{<tenant>}:<sha256(agent, subject)>``: whatever run id the caller
  sends, so a prompt-injected agent cannot reset it by picking a fresh ``X-Run-Id``;
- the run scope ``<prefix>:flowrun:{<tenant>}:<sha256(agent, subject, run id)>``, when the call has one.

Each hash field is ``<label>/<tool>`` -> the latest call time in ms; each record sets the key to expire
``flow.window_s`` after it, and a read drops the fields older than the window (a label seen once a day
ago is gone even if the key was kept alive by a newer one). A hash holds at most labels x tools fields, each with its call id beside it.

Costs: recording is one EVALSHA (``flow.record``, both scopes) added to the commit stage's round trip,
only for a tool that produces labels and only when its call returned output (``succeeded``: an error,
an unknown outcome or a partial answer put nothing of the tool's output before the model). Reading is
one EVALSHA (``flow.read``, both scopes), only for a call whose decision may use it: by default a tool
whose sink is external (``flow.read_for: every_call`` reads for every call). Every other call costs nothing.

Provenance (proxy/provenance.py) rides in the same two commands: a call of a tool whose output is untrusted
(or a ``trusted_source``) adds the fingerprints of its output's tokens to its ``flow.record``, into a third
hash of the principal scope ``<prefix>:prov:{<tenant>}:<sha256(agent, subject)>`` (field ``u<fp>`` or
``t<fp>`` -> ``<at ms>|<tool>|<call id>``; at most ``flow.provenance_max_values`` fields, past which the
``!over`` mark makes every unseen value count as untrusted); a call of a tool naming ``flow.sink_arguments``
looks its values' fingerprints up in its ``flow.read`` (HMGET) and gets ``input.flow.provenance``. Only the
principal scope is kept: a fresh run id must not wash a value.

Faults: a read that fails refuses the call (``dependency_unavailable``, nothing sent: the policy cannot
decide without it); a record that fails is logged (a warning) and does not change the call's answer
(the output was already produced).

Owns: the flow keys, the record and read scripts, and the ``input.flow`` document (its provenance entries
are provenance.py's).
Must never: take labels from anything but the trusted registry, let a run id choose the principal scope,
or cost a Redis command to a call whose tool neither produces labels nor needs them read.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import provenance, store
from .envelope import iso
from .identity import Caller
from .registry import ToolContract

log = logging.getLogger("toolproxy.flow")

LABELS = ("private", "untrusted", "secret")  # schemas/tool-registry.schema.json flow.produces
SINKS = ("internal", "external")

# KEYS[1]: principal scope; KEYS[2] (optional): run scope; then, when ARGV[4+n] is not empty, the provenance
# hash (last key). ARGV[1]: window in ms (the keys' expiry); ARGV[2]: "<the call's time in ms>|<call id>";
# ARGV[3]: n, the number of label fields; ARGV[4..3+n]: the fields "<label>/<tool>" -> the time (a field keeps
# its latest), and beside each "<label>/<tool>@" -> the call that brought it then (a held decision names its
# source call; a field apart, so a reader that knows only the times skips it).
# Provenance (proxy/provenance.py): ARGV[4+n]: "u" (untrusted output) or "t" (a trusted source) or "*" (each
# fingerprint carries its kind: a directory's output, "d<fp>" entries beside its "u"/"t" tokens) or "";
# ARGV[5+n]: the source "<tool>|<call id>"; ARGV[6+n]: the hash's bound; ARGV[7+n]: "1" when the output's
# own bound cut it; ARGV[8+n..]: the fingerprints. Each becomes the field "<u|t><fp>" -> "<at>|<source>";
# a full hash first drops the fields older than the window (at most once per tenth of a window), then sets
# the overflow mark for what did not fit.
_RECORD = store.lua("flow.record", """
local window = tonumber(ARGV[1])
local at_text, call = string.match(ARGV[2], '^(%d+)|(.*)$')
local at = tonumber(at_text)
local n = tonumber(ARGV[3])
local kind = ARGV[4 + n] or ''
local labelled = #KEYS
if kind ~= '' then labelled = #KEYS - 1 end
for k = 1, labelled do
  local key = KEYS[k]
  for i = 4, 3 + n do
    local old = tonumber(redis.call('HGET', key, ARGV[i]))
    if old == nil or old < at then
      redis.call('HSET', key, ARGV[i], at_text)
      if call ~= '' then redis.call('HSET', key, ARGV[i] .. '@', call) else redis.call('HDEL', key, ARGV[i] .. '@') end
    end
  end
  redis.call('PEXPIRE', key, ARGV[1])
end
if kind ~= '' then
  local key = KEYS[#KEYS]
  local value = at_text .. '|' .. ARGV[5 + n]
  local bound = tonumber(ARGV[6 + n])
  local over = ARGV[7 + n] == '1'
  local first = 8 + n
  local size = redis.call('HLEN', key)
  if size + #ARGV - first + 1 > bound then
    local pruned = tonumber(redis.call('HGET', key, '!pruned')) or 0
    if at - pruned > window / 10 then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        local t = tonumber(string.match(all[i + 1], '^(%d+)'))
        if t == nil or at - t >= window then redis.call('HDEL', key, all[i]) end
      end
      redis.call('HSET', key, '!pruned', at_text)
      size = redis.call('HLEN', key)
    end
  end
  for i = first, #ARGV do
    local field = ARGV[i]
    if kind ~= '*' then field = kind .. field end
    if redis.call('HSET', key, field, value) == 1 then
      size = size + 1
      if size > bound then
        redis.call('HDEL', key, field)
        size = size - 1
        over = true
      end
    end
  end
  if over then redis.call('HSET', key, '!over', value) end
  redis.call('PEXPIRE', key, ARGV[1])
end
return 1
""")

# KEYS as _RECORD's (the provenance hash last, when ARGV[2..] names fields). ARGV[1]: "2" with a run scope,
# else "1"; ARGV[2..]: the provenance fields to look up. Reply: {principal fields and values, run fields and
# values (empty without a run scope), the looked-up values (nil when absent)}.
_READ = store.lua("flow.read", """
local run = {}
if ARGV[1] == '2' then run = redis.call('HGETALL', KEYS[2]) end
local found = {}
if #ARGV > 1 then found = redis.call('HMGET', KEYS[#KEYS], unpack(ARGV, 2)) end
return {redis.call('HGETALL', KEYS[1]), run, found}
""")


@dataclass(frozen=True)
class Seen:
    label: str
    tool: str
    at_ms: int
    call: str = ""  # the call whose output brought the label last ("" for one recorded without its id)


@dataclass(frozen=True)
class FlowState:
    """The labels of both scopes within the window, as read for one decision."""

    principal: tuple[Seen, ...]
    run: tuple[Seen, ...] | None  # None: the call carries no run id
    window_s: int
    provenance: tuple[Mapping[str, Any], ...] | None = None  # None: the tool names no sink arguments
    payload: tuple[Mapping[str, Any], ...] | None = None  # None: the tool names no payload arguments

    def policy_input(self) -> dict[str, Any]:
        """``input.flow`` (schemas/opa-input.schema.json)."""
        scopes = [self.principal] + ([self.run] if self.run is not None else [])
        document = {"labels": sorted({s.label for scope in scopes for s in scope}),
                    "principal": _scope(self.principal),
                    "run": _scope(self.run) if self.run is not None else None,
                    "window_s": self.window_s}
        if self.provenance is not None:
            document["provenance"] = [dict(entry) for entry in self.provenance]
        if self.payload is not None:
            document["payload"] = [dict(entry) for entry in self.payload]
        return document


def _scope(seen: Sequence[Seen]) -> dict[str, Any]:
    return {"labels": sorted({s.label for s in seen}),
            "seen": [{"label": s.label, "tool": s.tool, "at": iso(s.at_ms / 1000.0), **({"call_id": s.call} if s.call else {})}
                     for s in seen]}


def parse_scope(raw: Sequence[Any], *, now_ms: int, window_ms: int) -> tuple[Seen, ...]:
    """An HGETALL reply (flat field, value list) as the entries within the window, sorted by label then tool.
    Fields that are not ``<known label>/<tool>`` with an integer time are skipped (never trusted)."""
    found = []
    fields = {_text(raw[i]): _text(raw[i + 1]) for i in range(0, len(raw) - 1, 2)}
    for field, value in fields.items():
        label, _, tool = field.partition("/")
        if field.endswith("@"):
            continue  # the call id beside a label's time
        try:
            at_ms = int(value)
        except ValueError:
            continue
        if label in LABELS and tool and now_ms - at_ms < window_ms:
            found.append(Seen(label, tool, at_ms, fields.get(field + "@", "")[:128]))
    return tuple(sorted(found, key=lambda s: (s.label, s.tool)))


class FlowLedger:
    """Records and reads the flow labels of callers (one instance per process)."""

    def __init__(self, redis: Any, *, prefix: str, window_s: int, read_for: str = "external_sinks",
                 fingerprint_key: bytes | None = None, provenance_max_values: int = 4096) -> None:
        self._prefix = prefix
        self._window_s = window_s
        self._window_ms = window_s * 1000
        self._every_call = read_for == "every_call"
        # a process without the MAC key's derived key (a unit test) still fingerprints, under a key of its own
        self._fingerprints = provenance.Fingerprints(fingerprint_key or secrets.token_bytes(32))
        self._lookups = provenance.Lookups(self._fingerprints)
        self._max_values = provenance_max_values
        self._record = store.script(redis, _RECORD)
        self._read = store.script(redis, _READ)

    @property
    def window_s(self) -> int:
        return self._window_s

    def keys(self, caller: Caller, run_id: str | None, *, provenance: bool = False) -> list[str]:
        """[principal scope, run scope (with a run id), the principal's value fingerprints (``provenance``:
        provenance.py)]: one hash tag (the tenant), so one Cluster slot."""
        who = f"{caller.agent}\x00{caller.subject}"
        principal = _digest(who)
        keys = [store.key(self._prefix, "flow", caller.tenant, principal)]
        if run_id is not None:
            keys.append(store.key(self._prefix, "flowrun", caller.tenant, _digest(f"{who}\x00{run_id}")))
        if provenance:
            keys.append(store.key(self._prefix, "prov", caller.tenant, principal))
        return keys

    def wanted(self, tool: ToolContract) -> bool:
        """Whether this call's decision reads the labels (``flow.read_for``; a tool naming sink arguments
        always: its provenance is read in the same command)."""
        return self._every_call or tool.flow_sink == "external" or tool.looks_up_provenance

    async def read(self, caller: Caller, run_id: str | None, *, now_ms: int, tool: ToolContract | None = None,
                   arguments: Mapping[str, Any] | None = None,
                   task: provenance.TaskContext | None = None) -> FlowState:
        """Both scopes and, for a ``tool`` naming sink arguments, the provenance of their values in
        ``arguments``: one command; a store fault refuses the call (nothing was sent)."""
        scopes = "2" if run_id is not None else "1"
        lookup, fields = (_lookup(self._lookups, tool, arguments or {})
                          if tool is not None and tool.looks_up_provenance else (None, ()))
        keys = self.keys(caller, run_id, provenance=lookup is not None)
        with store.unavailable_on_fault("The state store is unreachable; the call's data-flow context cannot be "
                                        "read, nothing was sent.", phase="authorize"):
            principal, run, found = await store.redis_call(self._read(keys=keys, args=[scopes, *fields]))
        entries = payload = None
        if lookup is not None:
            entries, payload = lookup.provenance(found, task=task, now_ms=now_ms, window_ms=self._window_ms)
        return FlowState(principal=parse_scope(principal, now_ms=now_ms, window_ms=self._window_ms),
                         run=parse_scope(run, now_ms=now_ms, window_ms=self._window_ms) if run_id is not None
                         else None, window_s=self._window_s,
                         provenance=tuple(entries) if tool is not None and tool.flow_sink_arguments else None,
                         payload=tuple(payload) if tool is not None and tool.flow_payload_arguments else None)

    async def note(self, caller: Caller, run_id: str | None, labels: Sequence[str], source: str, *,
                   now_ms: int, content: Any = None, call_id: str = "") -> None:
        """Labels brought into the caller's context by something other than a call's output (an MCP upstream's
        relayed request: ``source`` names the tool whose upstream sent it), and, with ``content`` (what was
        relayed, untrusted), the fingerprints of its tokens; one command. A store fault is
        ``dependency_unavailable``: the caller must not see what could not be labelled."""
        fields = [f"{label}/{source}" for label in labels if label in LABELS]
        extracted = provenance.extract(content) if content is not None else None
        if not fields and not (extracted and (extracted.tokens or extracted.overflow)):
            return
        keys = self.keys(caller, run_id, provenance=extracted is not None)
        args: list[Any] = [self._window_ms, _stamp(now_ms, call_id), len(fields), *fields]
        if extracted is not None:
            args += self._provenance_args("u", f"{source}|{call_id[:128]}", extracted)
        else:
            args.append("")
        with store.unavailable_on_fault("The state store is unreachable; the relayed message's data-flow "
                                        "label cannot be recorded.", phase="execute"):
            await store.redis_call(self._record(keys=keys, args=args))

    def _provenance_args(self, kind: str, source: str, extracted: provenance.Extracted,
                         listed: Sequence[str] = ()) -> list[Any]:
        """The record script's provenance arguments (see _RECORD); ``listed``: a directory's entries, recorded
        beside the tokens (each fingerprint then carries its own kind)."""
        tokens = [self._fingerprints.of(token) for token in extracted.tokens]
        if listed:
            tokens = [kind + fp for fp in tokens] + [provenance.DIRECTORY + self._fingerprints.of(e) for e in listed]
            kind = "*"
        return [kind, source, self._max_values, "1" if extracted.overflow else "0", *tokens]

    def record_in(self, trip: store.RoundTrip, caller: Caller, run_id: str | None, tool: ToolContract, *,
                  now_ms: int, output: Any = None, call_id: Any = "") -> None:
        """Add the record of a call that returned ``output`` of a labelled tool (or a trusted source) to the
        commit's round trip: its labels, and the fingerprints of the output's tokens (provenance.py)."""
        if not tool.flow_produces and not tool.records_provenance:
            return
        fields = [f"{label}/{tool.name}" for label in tool.flow_produces]
        fingerprinted = bool(tool.records_provenance) and output is not None
        keys = self.keys(caller, run_id, provenance=fingerprinted)
        args: list[Any] = [self._window_ms, _stamp(now_ms, call_id), len(fields), *fields]
        if fingerprinted:
            args += self._provenance_args("t" if tool.flow_trusted_source else "u",
                                          f"{tool.name}|{str(call_id)[:128]}", provenance.extract(output),
                                          provenance.directory_entries(output, tool.flow_directory))
        else:
            args.append("")
        trip.add(self._record, keys, args, lambda reply: _recorded(reply, tool))


def _lookup(lookups: provenance.Lookups, tool: ToolContract, arguments: Mapping[str, Any]
            ) -> tuple[provenance.Lookup, tuple[str, ...]]:
    """What a call of ``tool`` looks up (its sink values and, for a state_changing internal write, whether
    each is a directory's entry; its payload values) and the hash fields it asks for."""
    return lookups.of(arguments, tool.flow_sink_arguments, tool.flow_payload_arguments,
                      directory=tool.flow_sink != "external" and tool.flow_integrity == "state_changing")


def _recorded(reply: Any, tool: ToolContract) -> None:
    if isinstance(reply, BaseException):  # the output already went out: logged, the answer stands
        log.warning("could not record the flow labels %s of %s (%s): a later decision will not see them",
                    ",".join(tool.flow_produces), tool.name, type(reply).__name__)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _stamp(now_ms: int, call_id: Any) -> str:
    """A label's value: when, and which call brought it (bounded: the call id is the caller's)."""
    return f"{now_ms}|{str(call_id or '')[:128]}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def script_key_sets(prefix: str) -> Mapping[str, Sequence[Sequence[str]]]:
    """The keys of the flow scripts for a sample caller with a run id (runtime.check_key_layout)."""
    who = "agent\x00subject"
    keys = [store.key(prefix, "flow", "tenant", _digest(who)),
            store.key(prefix, "flowrun", "tenant", _digest(f"{who}\x00run"))]
    keys.append(store.key(prefix, "prov", "tenant", _digest(who)))
    return {"flow.record": [keys], "flow.read": [keys]}
