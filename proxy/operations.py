"""Operation records in Redis: the idempotency state machine.

Owns: the record of one operation (one idempotency key) and every transition
of it, each one atomic Lua script registered once per process:

    ABSENT -> IN_PROGRESS -> SUCCEEDED | FAILED_RETRYABLE | FAILED_FINAL | UNKNOWN
    IN_PROGRESS (lease ran out, write) -> UNKNOWN
    FAILED_RETRYABLE -> IN_PROGRESS (same key, attempt + 1) | FAILED_FINAL (attempts used up)
    UNKNOWN -> SUCCEEDED | FAILED_RETRYABLE | FAILED_FINAL (reconciled) | NEEDS_TAKEOVER
    UNKNOWN, NEEDS_TAKEOVER -> SUCCEEDED | FAILED_RETRYABLE | FAILED_FINAL (operator with evidence)
    IN_PROGRESS -> CANCELLED (a requested cancellation, with evidence nothing was applied; final)
    IN_PROGRESS -> NEEDS_TAKEOVER (the contract's independent read after the write contradicts its commit)

plus two marks that never change the state (proxy/transactions/cancellation.py, proxy/transactions/compensation.py):
``cancel`` (an IN_PROGRESS record whose cancellation was requested: shown as CANCELLING)
and ``compensation`` (a SUCCEEDED record's compensation block: requested, succeeded, failed, unknown),

and three per-bucket indexes kept in the same scripts: ``leases``
(IN_PROGRESS keys by lease expiry, so a dead proxy's calls are found without
a new request), ``open`` (UNKNOWN and NEEDS_TAKEOVER keys by the time they
became unknown: ``toolproxy_open_unknowns`` and the oldest one's age) and
``due`` (UNKNOWN keys by their next reconciliation attempt).

Keys: ``<prefix>:op:{op<b>}:<key>`` and ``<prefix>:op-leases|op-open|op-due:{op<b>}``
where ``b`` is the first hex digit of the
operation key's hash: 16 hash-tagged buckets, so every script touches one
Redis Cluster slot and the reconciler scans 16 small indexes (one slot each,
so one bucket whose master is down does not stop the sweep of the others).
Times are Redis server time (``TIME``) in milliseconds, taken by the master
that holds the keys, so replicas with skewed clocks agree.

Durability (``redis.min_replica_acks``): the transitions that must survive a
failover -- a write's reservation and every committed outcome (SUCCEEDED,
FAILED_*, UNKNOWN, takeover) -- run with ``WAIT`` on the same connection; a
shortfall is reported to ``on_shortfall`` (logged and counted), not fatal.

Must never: decide what a state means for a caller (the idempotency stage
does), talk to a backend, or leave a record half-written (every transition is
one script).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import orjson

from . import store
from .integrity import RecordMac
from .normalize import digest
from . import record_text
from .outcome_forms import OutcomeContext, expand

log = logging.getLogger("toolproxy.operations")

BUCKETS = "0123456789abcdef"
# The largest operation record a script reads and hands to the proxy: twice the largest answer a tool may give
# (its data, and an MCP answer's content beside its structured data) and then some; ``answer_bound_problem``
# keeps the answer bounds under it. A larger record is refused inside the script (``oversized``), before
# it is unpacked or sent: a Redis writer cannot make the proxy read and parse a planted 48 MB text.
MAX_RECORD_BYTES = 40 * 1024 * 1024
SHORTFALL_LOG_INTERVAL_S = 60.0
STATES = ("IN_PROGRESS", "SUCCEEDED", "FAILED_RETRYABLE", "FAILED_FINAL", "UNKNOWN", "NEEDS_TAKEOVER", "CANCELLED")
OPEN_STATES = ("UNKNOWN", "NEEDS_TAKEOVER")

# Whether a record (a string, or an earlier version's hash) is larger than MAX_RECORD_BYTES, by its length alone
# (STRLEN / HSTRLEN: nothing of it is copied into the script). Under an ACL from before these two commands were
# needed, the lengths are taken from the values themselves (slower for a large record, but still never sent on).
_OVERSIZED = r"""
local function oversized(name, kind)
  local size = 0
  if kind == 'string' then
    size = redis.pcall('STRLEN', name)
    if type(size) ~= 'number' then size = #redis.call('GET', name) end
  elseif kind == 'hash' then
    for _, f in ipairs(redis.call('HKEYS', name)) do
      local n = redis.pcall('HSTRLEN', name, f)
      if type(n) ~= 'number' then n = #(redis.call('HGET', name, f) or '') end
      size = size + #f + n
    end
  end
  return size > %d
end
""" % MAX_RECORD_BYTES

# The record is one Redis string: a MessagePack map (``cmsgpack``) of short field names (``FIELDS``) to string
# values (the meta and the outcome packed by ``record_text``, opaque to the scripts: they index by the record's
# own ``tenant`` field), read once by a script and written once at its end (``save``); the scripts' bodies
# speak the long names through ``field``/``hset``/``hdel``. A record written as a hash by an earlier version
# is read as one and rewritten packed by its next change (``save``), keeping its TTL; ``get`` reads either.
_PRELUDE = r"""
local rec, leases, open, due, held = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local now = now_ms()
local SHORT = %(short)s
local R, changed, ttl_ms = nil, false, nil
local kind = redis.call('TYPE', rec)['ok']
%(oversized)s
if oversized(rec, kind) then return {'oversized'} end  -- never read, unpacked or sent to the proxy
if kind == 'string' then
  R = cmsgpack.unpack(redis.call('GET', rec))
elseif kind == 'hash' then  -- an earlier version's record
  local flat = redis.call('HGETALL', rec)
  R = {}
  for i = 1, #flat, 2 do R[SHORT[flat[i]] or flat[i]] = flat[i + 1] end
end
-- Records held (``held_records``): each record is counted once in its bucket's ``held`` hash, under the hour
-- its TTL ends ('p': no TTL, an unresolved unknown) and marked 'held'; ``save`` moves the count when the TTL
-- moves to another hour and takes it back when the record is deleted. An earlier version's record is
-- counted from its first change on.
local expiry_was, counted_was = nil, R ~= nil and R[SHORT['held']] == '1'
if R then
  local left = redis.call('PTTL', rec)
  if left == -1 then expiry_was = -1 elseif left >= 0 then expiry_was = now + left end
end
local function held_slot(expiry)
  if expiry == nil then return nil end
  if expiry == -1 then return 'p' end
  return tostring(math.floor(expiry / 3600000))
end
local function field(name) return R and R[SHORT[name]] end
local function text(value)
  if type(value) == 'number' and value == math.floor(value) then return string.format('%%d', value) end
  return tostring(value)
end
local function hset(...)
  local args = {...}
  R = R or {}
  for i = 1, #args, 2 do R[SHORT[args[i]]] = text(args[i + 1]) end
  changed = true
end
local function hdel(...)
  for _, name in ipairs({...}) do
    if R and R[SHORT[name]] ~= nil then R[SHORT[name]] = nil; changed = true end
  end
end
local function pexpire(ms) ttl_ms = ms end
local function persist() ttl_ms = -1 end
local function del() R, changed, ttl_ms = nil, true, nil end
local function save()
  local slot_was = counted_was and held_slot(expiry_was) or nil
  if changed and R == nil then
    redis.call('DEL', rec)
    if slot_was then redis.call('HINCRBY', held, slot_was, -1) end
    return
  end
  if R == nil or (not changed and not ttl_ms) then return end  -- a replay, a refusal: nothing is written
  local expiry_now = expiry_was
  if ttl_ms == -1 then expiry_now = -1 elseif ttl_ms then expiry_now = now + ttl_ms end
  local slot_now = held_slot(expiry_now)
  if slot_now ~= slot_was then
    if slot_was then redis.call('HINCRBY', held, slot_was, -1) end
    if slot_now then
      redis.call('HINCRBY', held, slot_now, 1)
      if R[SHORT['held']] ~= '1' then R[SHORT['held']] = '1'; changed = true end
    end
  end
  if changed then redis.call('SET', rec, cmsgpack.pack(R), 'KEEPTTL') end
  if ttl_ms == -1 then redis.call('PERSIST', rec) elseif ttl_ms then redis.call('PEXPIRE', rec, ttl_ms) end
end
-- The record's tenant's own open index beside the bucket's (same hash tag, so the same slot): a noisy
-- tenant's unknowns never push another tenant's out of its operators' listing (``open_keys``).
local function tenant_open()
  local tenant = field('tenant')
  if not tenant then  -- an earlier version's record: the tenant is in its (JSON) meta
    local ok, meta = pcall(cjson.decode, field('meta') or '')
    tenant = ok and type(meta) == 'table' and meta['tenant'] or ''
  end
  return open .. ':t:' .. tostring(tenant)
end
local function to_unknown(first_ms, window_ms, evidence, outcome)
  hset('state', 'UNKNOWN', 'updated_at', now, 'unknown_since', now,
             'rec_until', now + window_ms, 'rec_next', now + first_ms, 'rec_attempts', 0, 'evidence', evidence)
  if outcome ~= '' then hset('outcome', outcome) end
  hdel('lease_until', 'rec_owner', 'rec_owner_until', 'takeover_at')
  persist()  -- an unresolved unknown never expires
  redis.call('ZREM', leases, id)
  redis.call('ZADD', open, now, id)
  redis.call('ZADD', tenant_open(), now, id)
  redis.call('ZADD', due, now + first_ms, id)
end
local function settle(state, outcome, evidence, mac)
  local was = field('state')
  if was == 'UNKNOWN' or was == 'NEEDS_TAKEOVER' then redis.call('ZREM', tenant_open(), id) end
  hset('state', state, 'updated_at', now)
  if outcome ~= '' then hset('outcome', outcome) end
  if mac ~= '' then hset('omac', mac) else hdel('omac') end
  if evidence == '=' then hdel('evidence') elseif evidence ~= '' then hset('evidence', evidence) end
  hdel('lease_until', 'rec_owner', 'rec_owner_until', 'owner')
  redis.call('ZREM', leases, id)
  redis.call('ZREM', open, id)
  redis.call('ZREM', due, id)
  pexpire(tonumber(field('retention')) * 1000)
end
"""

# Long name (the scripts' and ``Record``'s) -> the short name stored. A new field gets a new short name here.
FIELDS = {"state": "s", "attempt": "a", "token": "t", "owner": "o", "lease_until": "l", "updated_at": "u",
          "created_at": "c", "fp": "f", "is_write": "w", "meta": "m", "retention": "r", "outcome": "x",
          "omac": "y", "evidence": "e", "final_reason": "fr", "unknown_since": "us", "rec_until": "ru",
          "rec_next": "rn", "rec_attempts": "ra", "rec_owner": "ro", "rec_owner_until": "rt",
          "takeover_at": "ta", "cancel": "k", "compensation": "p", "held": "h", "tenant": "n", "mmac": "mm"}
LONG_NAMES = {short: long for long, short in FIELDS.items()}
_SHORT_LUA = "{" + ", ".join(f"{long} = '{short}'" for long, short in FIELDS.items()) + "}"


def _script(body: str) -> str:
    """A transition script: the prelude, ``body`` (which may return anywhere), then the record saved once."""
    return (_PRELUDE % {"short": _SHORT_LUA, "oversized": _OVERSIZED}
            + "local function body()\n" + body
            + "\nend\nlocal result = body()\nsave()\nreturn result\n")


# ARGV: id, fingerprint, nonce, lease_ms, retention_s, is_write, max_attempts, meta, first_ms, window_ms,
#       observe ("1": answer from the record only, never create or reserve it -> not_admitted (state)), tenant,
#       the MAC of (key, fingerprint, tenant, meta) (proxy/integrity.py; written with the meta, never changed)
_BEGIN = store.lua("operations.begin", _script(r"""
local fp, nonce = ARGV[2], ARGV[3]
local observe = ARGV[11] == "1"
local lease_ms, retention_s, max_attempts = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local function start(attempt, token)
  hset('state', 'IN_PROGRESS', 'attempt', attempt, 'token', token, 'owner', nonce,
             'lease_until', now + lease_ms, 'updated_at', now)
  hdel('cancel')  -- a new attempt starts without an earlier attempt's cancel request
  redis.call('ZADD', leases, now + lease_ms, id)
  pexpire(math.max(retention_s * 1000, 2 * lease_ms))
  if attempt == 1 then return {'new', token, attempt} end
  return {'retry', token, attempt}
end
local state = field('state')
if not state then
  if observe then return {'not_admitted', 'ABSENT'} end
  hset('fp', fp, 'is_write', ARGV[6], 'meta', ARGV[8], 'tenant', ARGV[12], 'mmac', ARGV[13], 'created_at', now,
             'retention', retention_s)
  return start(1, 1)
end
if field('fp') ~= fp then return {'conflict', state} end
if state == 'IN_PROGRESS' then
  if field('owner') == nonce then  -- this very request, its script call repeated after a lost reply
    local attempt = tonumber(field('attempt'))
    return {attempt == 1 and 'new' or 'retry', tonumber(field('token')), attempt}
  end
  local lease_until = tonumber(field('lease_until'))
  if lease_until > now then return {'in_progress', lease_until - now} end
  if field('is_write') == '1' then
    to_unknown(tonumber(ARGV[9]), tonumber(ARGV[10]),
               cjson.encode({source = 'proxy', observed = 'lease_expired', at_ms = now}), '')
    return {'unknown', 'UNKNOWN', 1}
  end
  state = 'FAILED_RETRYABLE'  -- a read whose executor died: nothing to reconcile, run it again
end
-- An outcome handed back is checked against its MAC ('omac') by the caller before it is honoured.
if state == 'SUCCEEDED' then return {'replay', field('outcome') or '', field('omac') or ''} end
if state == 'FAILED_FINAL' then
  return {'final', field('outcome') or '', field('final_reason') or '', field('omac') or '', state}
end
if state == 'CANCELLED' then return {'final', field('outcome') or '', 'cancelled', field('omac') or '', state} end
if state == 'UNKNOWN' or state == 'NEEDS_TAKEOVER' then return {'unknown', state, 0} end
if observe then return {'not_admitted', state} end
local attempt = tonumber(field('attempt'))
if attempt >= max_attempts then
  hset('final_reason', 'attempts_exhausted')
  settle('FAILED_FINAL', '', '', '')
  return {'exhausted', attempt}
end
return start(attempt + 1, tonumber(field('token')) + 1)
"""))

# ARGV: id, token, target (SUCCEEDED|FAILED_RETRYABLE|FAILED_FINAL|CANCELLED|UNKNOWN|ABANDON), outcome, evidence,
#       first_ms, window_ms, the MAC of (target, outcome) (proxy/integrity.py; stored with a settled record)
_COMMIT = store.lua("operations.commit", _script(r"""
local target, outcome, evidence = ARGV[3], ARGV[4], ARGV[5]
local state = field('state')
if not state then return {'missing', 'ABSENT'} end
if tonumber(field('token')) ~= tonumber(ARGV[2]) then return {'stale', state} end
if state == 'IN_PROGRESS' then
  if target == 'ABANDON' then  -- nothing was sent: undo the reservation
    local attempt = tonumber(field('attempt'))
    if attempt <= 1 then
      del()
      redis.call('ZREM', leases, id)
      return {'ok', 'ABSENT'}
    end
    hset('attempt', attempt - 1)
    settle('FAILED_RETRYABLE', '', evidence, '')
    return {'ok', 'FAILED_RETRYABLE'}
  end
  if target == 'UNKNOWN' then
    to_unknown(tonumber(ARGV[6]), tonumber(ARGV[7]), evidence, outcome)
    return {'ok', 'UNKNOWN'}
  end
  if target == 'TAKEOVER' then  -- unknown, and no status query can settle it: straight to a person
    to_unknown(tonumber(ARGV[6]), tonumber(ARGV[7]), evidence, outcome)
    hset('state', 'NEEDS_TAKEOVER', 'takeover_at', now)
    redis.call('ZREM', due, id)
    return {'ok', 'NEEDS_TAKEOVER'}
  end
  settle(target, outcome, evidence, ARGV[8])
  return {'ok', target}
end
if state == 'UNKNOWN' or state == 'NEEDS_TAKEOVER' then
  -- Our lease ran out before we could record, but we hold a definite answer: it settles the record.
  local mac = ARGV[8]
  if target == 'ABANDON' then target, mac = 'FAILED_RETRYABLE', '' end
  if target == 'UNKNOWN' or target == 'TAKEOVER' then return {'ok', state} end
  settle(target, outcome, evidence, mac)
  return {'late', target}
end
return {'settled', state}
"""))

# ARGV: id, token, lease_ms
_RENEW = store.lua("operations.renew", _script(r"""
local state = field('state')
if state == 'IN_PROGRESS' and tonumber(field('token')) == tonumber(ARGV[2]) then
  hset('lease_until', now + tonumber(ARGV[3]))
  redis.call('ZADD', leases, now + tonumber(ARGV[3]), id)
  return {'ok', state}
end
return {'lost', state or 'ABSENT'}
"""))

# ARGV: id, first_ms, window_ms
_EXPIRE = store.lua("operations.expire", _script(r"""
local state = field('state')
if state ~= 'IN_PROGRESS' then
  redis.call('ZREM', leases, id)
  return {'stale', state or 'ABSENT'}
end
local lease_until = tonumber(field('lease_until'))
if lease_until > now then
  redis.call('ZADD', leases, lease_until, id)
  return {'alive', state}
end
if field('is_write') == '1' then
  to_unknown(tonumber(ARGV[2]), tonumber(ARGV[3]),
             cjson.encode({source = 'proxy', observed = 'lease_expired', at_ms = now}), '')
  return {'unknown', 'UNKNOWN'}
end
settle('FAILED_RETRYABLE', '', '', '')
return {'released', 'FAILED_RETRYABLE'}
"""))

# ARGV: id, owner, claim_ms
_CLAIM = store.lua("operations.claim", _script(r"""
local state = field('state')
if state ~= 'UNKNOWN' then  -- settled, handed over or gone: nothing left to schedule
  redis.call('ZREM', due, id)
  if state ~= 'NEEDS_TAKEOVER' then
    redis.call('ZREM', open, id)
    if state then redis.call('ZREM', tenant_open(), id) end
  end
  return {'not_unknown', state or 'ABSENT'}
end
local owner_until = tonumber(field('rec_owner_until') or '0')
if owner_until > now then
  redis.call('ZADD', due, owner_until, id)
  return {'busy'}
end
local next_at = tonumber(field('rec_next'))
if next_at > now then
  redis.call('ZADD', due, next_at, id)
  return {'not_due'}
end
hset('rec_owner', ARGV[2], 'rec_owner_until', now + tonumber(ARGV[3]))
redis.call('ZADD', due, now + tonumber(ARGV[3]), id)
return {'claimed', now}
"""))

# ARGV: id, owner, verdict (SUCCEEDED|FAILED_RETRYABLE|FAILED_FINAL|WATCH|TAKEOVER), outcome, evidence, delay_ms,
#       the MAC of (verdict, outcome)
_RESOLVE = store.lua("operations.resolve", _script(r"""
local state = field('state')
if not state then
  redis.call('ZREM', open, id)
  redis.call('ZREM', due, id)
  return {'gone', 'ABSENT'}
end
if field('rec_owner') ~= ARGV[2] then return {'lost', state} end
hdel('rec_owner', 'rec_owner_until')
if state ~= 'UNKNOWN' then return {'settled', state} end
local verdict, outcome, evidence = ARGV[3], ARGV[4], ARGV[5]
hset('rec_attempts', (tonumber(field('rec_attempts')) or 0) + 1)
if verdict == 'WATCH' then
  local next_at = now + tonumber(ARGV[6])
  hset('rec_next', next_at, 'evidence', evidence, 'updated_at', now)
  redis.call('ZADD', due, next_at, id)
  return {'ok', 'UNKNOWN'}
end
if verdict == 'TAKEOVER' then
  hset('state', 'NEEDS_TAKEOVER', 'takeover_at', now, 'evidence', evidence, 'updated_at', now)
  redis.call('ZREM', due, id)
  return {'ok', 'NEEDS_TAKEOVER'}
end
settle(verdict, outcome, evidence, ARGV[7])
return {'ok', verdict}
"""))

# ARGV: id, verdict (SUCCEEDED|FAILED_RETRYABLE|FAILED_FINAL), outcome, evidence, the MAC of (verdict, outcome)
_OPERATOR = store.lua("operations.operator", _script(r"""
local state = field('state')
if not state then return {'missing', 'ABSENT'} end
if state ~= 'UNKNOWN' and state ~= 'NEEDS_TAKEOVER' then return {'not_open', state} end
settle(ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return {'ok', ARGV[2]}
"""))


# ARGV: id, request (JSON). Marks an IN_PROGRESS record's cancellation as requested, once.
_CANCEL = store.lua("operations.cancel", _script(r"""
local state = field('state')
if not state then return {'missing', 'ABSENT'} end
local existing = field('cancel')
if state ~= 'IN_PROGRESS' then return {'settled', state, existing or ''} end
if existing then return {'already', state, existing} end
hset('cancel', ARGV[2], 'updated_at', now)
return {'marked', state, ARGV[2]}
"""))

# ARGV: id, block (JSON), allowed current block statuses ("," separated; "none" = no block yet), state wanted.
# Sets a settled record's compensation block when its state and current block allow it; never changes the state.
_COMPENSATION = store.lua("operations.compensation", _script(r"""
local state = field('state')
if not state then return {'missing', 'ABSENT'} end
local current = field('compensation') or ''
if state ~= ARGV[4] then return {'state', state, current} end
local status = 'none'
if current ~= '' then status = cjson.decode(current)['status'] end
for allowed in string.gmatch(ARGV[3], '[^,]+') do
  if allowed == status then
    hset('compensation', ARGV[2])
    return {'ok', state, ARGV[2]}
  end
end
return {'refused', state, current}
"""))


# KEYS[1] a record. Its packed value ({'p', value}), an earlier version's hash ({'h', field, value, ...}), {},
# or {'o'}: larger than MAX_RECORD_BYTES (never sent to the proxy).
_READ = store.lua("operations.read", r"""
local kind = redis.call('TYPE', KEYS[1])['ok']
%(oversized)s
if oversized(KEYS[1], kind) then return {'o'} end
if kind == 'string' then return {'p', redis.call('GET', KEYS[1])} end
if kind ~= 'hash' then return {} end
local flat = redis.call('HGETALL', KEYS[1])
table.insert(flat, 1, 'h')
return flat
""" % {"oversized": _OVERSIZED})

# KEYS[1] an index (sorted set scored by Redis ms). ARGV: limit. Members whose score passed, by this master's clock.
_PASSED = store.lua("operations.passed", r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
""")


@dataclass(frozen=True)
class Transition:
    """What a script answered: ``status`` plus its positional values."""

    status: str
    values: tuple[Any, ...] = ()
    then_reply: Any = None  # a chained call's reply (``begin(then=...)``), or None if it did not run

    def int(self, index: int) -> int:
        return int(self.values[index])

    def text(self, index: int) -> str:
        return self.values[index] if index < len(self.values) else ""


@dataclass(frozen=True)
class Record:
    """One operation record as read from Redis (times in Redis milliseconds)."""

    key: str
    state: str
    attempt: int
    token: int
    is_write: bool
    meta: Mapping[str, Any]
    created_at: int
    updated_at: int
    retention_s: int
    lease_until: int | None = None
    outcome: Mapping[str, Any] | None = None
    evidence: Mapping[str, Any] | None = None
    final_reason: str | None = None
    unknown_since: int | None = None
    reconcile_until: int | None = None
    reconcile_next: int | None = None
    reconcile_attempts: int = 0
    takeover_at: int | None = None
    owner: str | None = None  # the nonce of the request holding an IN_PROGRESS record
    cancel: Mapping[str, Any] | None = None        # a requested cancellation (proxy/transactions/cancellation.py)
    compensation: Mapping[str, Any] | None = None  # the compensation block (proxy/transactions/compensation.py)
    fingerprint: str = ""          # (subject, contract version, args_hash) digest the key was reserved with
    outcome_text: str = ""         # the stored outcome as written (what its MAC covers)
    outcome_mac: str | None = None  # proxy/integrity.py; OperationStore.record_verified checks it
    meta_text: str = ""            # the stored meta as written (what its MAC covers, with the tenant)
    meta_mac: str | None = None    # proxy/integrity.py; OperationStore.record_verified checks it too

    @property
    def tenant(self) -> str:
        return str(self.meta.get("tenant", ""))

    @property
    def tool(self) -> str:
        return str(self.meta.get("tool", ""))

    @property
    def tool_version(self) -> str:
        return str(self.meta.get("tool_version", ""))


def bucket_of(key: str) -> str:
    """The bucket of an operation key ``ik_<sha256 hex>``."""
    return key[3]


def record_keys(prefix: str, key: str) -> list[str]:
    """KEYS of every transition script: the record and its bucket's leases, open and due indexes, and the
    count of the records it holds (by the hour their TTL ends)."""
    tag = "op" + bucket_of(key)
    return [store.key(prefix, "op", tag, key), store.key(prefix, "op-leases", tag),
            store.key(prefix, "op-open", tag), store.key(prefix, "op-due", tag), store.key(prefix, "op-held", tag)]


def script_key_sets(prefix: str) -> dict[str, list[list[str]]]:
    """The key set of a transition in every bucket (start-up check: each in one Cluster slot)."""
    return {"operations": [record_keys(prefix, "ik_" + bucket + "0" * 63) for bucket in BUCKETS]}


class OperationStore:
    """The Redis side of idempotency: one instance per process, on the shared client."""

    def __init__(self, redis: store.Client, prefix: str, *, mac: RecordMac, replica_acks: int = 0,
                 ack_timeout_ms: int = 200, on_shortfall: Callable[[str], None] | None = None) -> None:
        self._redis = self.redis = redis
        self._mac = mac
        self._prefix = prefix
        self._replica_acks = replica_acks
        self._ack_timeout_ms = ack_timeout_ms
        self._on_shortfall = on_shortfall or (lambda transition: None)
        self._shortfall_logged = 0.0
        self._begin = store.script(redis, _BEGIN)
        self._commit = store.script(redis, _COMMIT)
        self._renew = store.script(redis, _RENEW)
        self._expire = store.script(redis, _EXPIRE)
        self._claim = store.script(redis, _CLAIM)
        self._resolve = store.script(redis, _RESOLVE)
        self._operator = store.script(redis, _OPERATOR)
        self._passed = store.script(redis, _PASSED)
        self._read = store.script(redis, _READ)
        self._cancel = store.script(redis, _CANCEL)
        self._compensation = store.script(redis, _COMPENSATION)
        self._chains: dict[str, Any] = {}  # then-script sha -> begin chained with it (None: not possible)
        self._commit_chains: dict[str, Any] = {}  # then-script sha -> commit chained with it (None: not possible)
        self._durable = {self._begin: "begin", self._commit: "commit", self._expire: "expire",
                         self._resolve: "resolve", self._operator: "operator", self._cancel: "cancel",
                         self._compensation: "compensation"}

    # -- key names -------------------------------------------------------------
    def _keys(self, key: str) -> list[str]:
        return record_keys(self._prefix, key)

    def _index(self, kind: str, bucket: str) -> str:
        return store.key(self._prefix, kind, "op" + bucket)

    async def _run(self, script: Any, key: str, *args: Any, replicate: bool = True,
                   then: store.Then | None = None) -> Transition:
        transition = self._durable.get(script) if replicate else None
        keys, call_args = self._keys(key), [key, *args]
        chain = self._chained(script, then) if then is not None else None
        if chain is not None:
            assert then is not None
            keys, call_args = then.joined(keys, call_args)
        runs = chain or script
        if transition is None or self._replica_acks <= 0:
            reply = await store.redis_call(runs(keys=keys, args=call_args))
        else:
            reply, acked = await store.run_replicated(self._redis, runs, keys, call_args,
                                                      acks=self._replica_acks, timeout_ms=self._ack_timeout_ms)
            if acked < self._replica_acks:
                self._shortfall(transition, acked)
        first = _transition(reply if chain is None else reply[0])
        if first.status == "oversized":
            raise RecordTooLarge(f"operation record {key} is larger than {MAX_RECORD_BYTES} bytes")
        return first if chain is None else replace(first, then_reply=reply[1] if len(reply) > 1 else None)

    def _chained(self, script: Any, then: store.Then) -> Any:
        """``begin`` and the call that follows a reservation (the first lock attempt) as one script, where one
        server holds both sets of keys; the follower runs only when the key was reserved (new or retry)."""
        sha = then.script.sha
        if sha not in self._chains:
            self._chains[sha] = store.chained(self._redis, script, then, proceed_if=_RESERVED)
        return self._chains[sha]

    def _shortfall(self, transition: str, acked: int) -> None:
        self._on_shortfall(transition)
        if time.monotonic() - self._shortfall_logged >= SHORTFALL_LOG_INTERVAL_S:  # at most once a minute
            self._shortfall_logged = time.monotonic()
            log.warning("redis: %s acknowledged by %d of %d replicas within %d ms; a failover now could lose it",
                        transition, acked, self._replica_acks, self._ack_timeout_ms)

    # -- transitions -----------------------------------------------------------
    async def begin(self, key: str, *, fingerprint: str, nonce: str, lease_ms: int, retention_s: int,
                    is_write: bool, max_attempts: int, meta: Mapping[str, Any], first_check_ms: int,
                    window_ms: int, observe: bool = False, then: store.Then | None = None) -> Transition:
        """new/retry (token, attempt) | in_progress (ms left) | replay (outcome) | final (outcome, reason)
        | unknown (state, 1 if it just became unknown) | conflict (state) | exhausted (attempt)
        | not_admitted (state; ``observe`` only: a new execution would be needed, nothing was reserved).

        ``then``: a script call to make in the same round trip only if this one reserved the key (new or
        retry), its reply in ``then_reply``; on a Cluster client it is not made (``then_reply`` None)."""
        text, tenant = _dumps(_stored_meta(meta)), str(meta.get("tenant", ""))
        meta_mac = self._mac.meta(key=key, fingerprint=fingerprint, tenant=tenant, meta=text)
        return await self._run(self._begin, key, fingerprint, nonce, lease_ms, retention_s, int(is_write),
                               max_attempts, record_text.pack(text), first_check_ms, window_ms, int(observe), tenant,
                               meta_mac, replicate=is_write and not observe, then=then)

    async def commit(self, key: str, *, token: int, target: str, outcome: Mapping[str, Any] | None,
                     evidence: Mapping[str, Any], first_check_ms: int, window_ms: int,
                     fingerprint: str = "") -> Transition:
        """ok/late (new state) | stale (state: another execution owns the key) | settled | missing.
        ``fingerprint``: the record's (``OperationKey.fingerprint``); without it a settled outcome carries no
        MAC and is never replayed."""
        stored, mac = self._stored_outcome(key, fingerprint, target, outcome)
        return await self._run(self._commit, key, token, target, stored, _evidence_text(target, evidence),
                               first_check_ms, window_ms, mac)

    def commit_in(self, trip: store.RoundTrip, key: str, *, token: int, target: str,
                  outcome: Mapping[str, Any] | None, evidence: Mapping[str, Any], first_check_ms: int,
                  window_ms: int, on_reply: Callable[[Transition | BaseException], None],
                  fingerprint: str = "", then: store.Then | None = None) -> None:
        """``commit`` as one step of a shared round trip (the commit stage sends it with the lock release).

        ``then``: a script call to make in the same script call only once the record holds an outcome (any
        answer but ``missing``; a commit that fails runs nothing after it), its reply in ``then_reply``;
        where one server does not hold both key sets (Cluster) it is not made (``then_reply`` None)."""
        stored, mac = self._stored_outcome(key, fingerprint, target, outcome)
        keys = self._keys(key)
        args: list[Any] = [key, token, target, stored, _evidence_text(target, evidence), first_check_ms, window_ms,
                           mac]
        chain = self._commit_chain(then) if then is not None else None
        if chain is not None:
            assert then is not None
            keys, args = then.joined(keys, args)

        def replied(reply: Any) -> None:
            if isinstance(reply, BaseException) or chain is None:
                return on_reply(reply if isinstance(reply, BaseException) else _transition(reply))
            on_reply(replace(_transition(reply[0]), then_reply=reply[1] if len(reply) > 1 else None))

        trip.add(chain or self._commit, keys, args, replied, acks=self._replica_acks, timeout_ms=self._ack_timeout_ms,
                 on_acked=self._check_acks("commit"))

    def _commit_chain(self, then: store.Then) -> Any:
        """``commit`` and what may only follow a recorded outcome (the lock release) as one script, where one
        server holds both key sets (None elsewhere)."""
        sha = then.script.sha
        if sha not in self._commit_chains:
            self._commit_chains[sha] = store.chained(self._redis, self._commit, then, proceed_if=_RECORDED)
        return self._commit_chains[sha]

    def _stored_outcome(self, key: str, fingerprint: str, state: str,
                        outcome: Mapping[str, Any] | None) -> tuple[str | bytes, str]:
        """What a transition stores of ``outcome`` (``record_text``'s packed form of its JSON text) and the MAC
        of that JSON text ("" when the state carries none, or without a fingerprint)."""
        text = _dumps(outcome) if outcome else ""
        if not fingerprint or state in ("UNKNOWN", "ABANDON", "WATCH", "TAKEOVER"):
            return record_text.pack(text), ""
        return record_text.pack(text), self._mac.outcome(key=key, fingerprint=fingerprint, state=state, outcome=text)

    def outcome_verified(self, key: str, *, fingerprint: str, state: str, outcome: str, mac: str | None) -> bool:
        """Whether a settled record's outcome is one a key holder recorded for this key, fingerprint and state."""
        return self._mac.outcome_matches(mac, key=key, fingerprint=fingerprint, state=state, outcome=outcome)

    def record_verified(self, record: "Record") -> bool:
        """``outcome_verified`` for a record read with ``get`` (its own fingerprint), and its meta and tenant
        (which name its tool and contract, its target, its compensation's inputs) those its first execution
        wrote: a record written before metas carried a MAC is not verified."""
        return self.outcome_verified(record.key, fingerprint=record.fingerprint, state=record.state,
                                     outcome=record.outcome_text, mac=record.outcome_mac) and \
            self._mac.same(self._mac.meta(key=record.key, fingerprint=record.fingerprint, tenant=record.tenant,
                                          meta=record.meta_text), record.meta_mac)

    def _check_acks(self, transition: str) -> Callable[[int], None]:
        def checked(acked: int) -> None:
            if acked < self._replica_acks:
                self._shortfall(transition, acked)
        return checked

    async def renew(self, key: str, *, token: int, lease_ms: int) -> Transition:
        return await self._run(self._renew, key, token, lease_ms)

    async def expire(self, key: str, *, first_check_ms: int, window_ms: int) -> Transition:
        return await self._run(self._expire, key, first_check_ms, window_ms)

    async def claim(self, key: str, *, owner: str, claim_ms: int) -> Transition:
        return await self._run(self._claim, key, owner, claim_ms)

    async def resolve(self, key: str, *, owner: str, verdict: str, outcome: Mapping[str, Any] | None,
                      evidence: Mapping[str, Any], delay_ms: int = 0, fingerprint: str = "") -> Transition:
        stored, mac = self._stored_outcome(key, fingerprint, verdict, outcome)
        return await self._run(self._resolve, key, owner, verdict, stored, _dumps(evidence), delay_ms, mac)

    async def resolve_by_operator(self, key: str, *, verdict: str, outcome: Mapping[str, Any] | None,
                                  evidence: Mapping[str, Any], fingerprint: str = "") -> Transition:
        stored, mac = self._stored_outcome(key, fingerprint, verdict, outcome)
        return await self._run(self._operator, key, verdict, stored, _dumps(evidence), mac)

    async def request_cancel(self, key: str, *, request: Mapping[str, Any]) -> Transition:
        """marked (state, request) | already (state, the first request) | settled (state, request or "")
        | missing."""
        return await self._run(self._cancel, key, _dumps(request))

    async def set_compensation(self, key: str, *, block: Mapping[str, Any], from_statuses: tuple[str, ...],
                               state: str = "SUCCEEDED") -> Transition:
        """ok (state, block) | refused (state, current block) | state (the record is in another state) | missing."""
        return await self._run(self._compensation, key, _dumps(block), ",".join(from_statuses), state)

    # -- reads -----------------------------------------------------------------
    async def get(self, key: str) -> Record | None:
        reply = await store.redis_call(self._read(keys=[self._keys(key)[0]], args=[]))
        if reply and reply[0] == b"o":
            raise RecordTooLarge(f"operation record {key} is larger than {MAX_RECORD_BYTES} bytes")
        return _record(key, record_fields(reply)) if reply else None

    async def expired_leases(self, bucket: str, limit: int) -> list[str]:
        """IN_PROGRESS keys of a bucket whose lease ran out (by the bucket master's clock)."""
        raw = await store.redis_call(self._passed(keys=[self._index("op-leases", bucket)], args=[limit]))
        return [k.decode() for k in raw]

    async def due(self, bucket: str, limit: int) -> list[str]:
        """UNKNOWN keys of a bucket due for a reconciliation attempt."""
        raw = await store.redis_call(self._passed(keys=[self._index("op-due", bucket)], args=[limit]))
        return [k.decode() for k in raw]

    async def sweep_candidates(self, limit: int) -> tuple[dict[str, list[str] | Exception],
                                                        dict[str, list[str] | Exception]]:
        """Per bucket: (IN_PROGRESS keys whose lease ran out, UNKNOWN keys due for a reconciliation attempt),
        at most ``limit`` of each, earliest first, by the clock of the bucket's master; a bucket whose
        master could not answer maps to its StoreError instead.

        The 32 index reads go in one pipeline: one round trip in standalone and sentinel mode, one per
        master in cluster mode (the pipeline splits by node). A bucket whose read failed there is read
        again on its own, so one unreachable master only costs its own buckets."""
        expired: dict[str, list[str] | Exception] = {}
        due: dict[str, list[str] | Exception] = {}
        trip = store.RoundTrip(self._redis)

        def keep(into: dict[str, list[str] | Exception], bucket: str) -> Callable[[Any], None]:
            def kept(reply: Any) -> None:
                into[bucket] = reply if isinstance(reply, BaseException) else [k.decode() for k in reply]
            return kept

        for bucket in BUCKETS:
            trip.add(self._passed, [self._index("op-leases", bucket)], [limit], keep(expired, bucket))
            trip.add(self._passed, [self._index("op-due", bucket)], [limit], keep(due, bucket))
        await trip.send()
        for bucket in BUCKETS:
            for into, read in ((expired, self.expired_leases), (due, self.due)):
                if isinstance(into[bucket], BaseException):  # the sweep reports a failed bucket and goes on
                    into[bucket] = await store.fault_as_value(read(bucket, limit))
        return expired, due

    async def open_keys(self, limit: int, *, tenant: str | None = None) -> list[str]:
        """UNKNOWN and NEEDS_TAKEOVER keys, oldest first (at most ``limit``): every tenant's, or one tenant's
        from its own index (kept beside the bucket's by the scripts, so other tenants never crowd it out)."""
        scored: list[tuple[float, str]] = []
        for bucket in BUCKETS:
            index = self._index("op-open", bucket) + ("" if tenant is None else f":t:{tenant}")
            raw = await store.redis_call(self._redis.zrange(index, 0, limit - 1, withscores=True))
            scored.extend((score, k.decode()) for k, score in raw)
        return [k for _, k in sorted(scored)[:limit]]

    async def open_stats(self) -> tuple[int, int | None]:
        """(records in UNKNOWN or NEEDS_TAKEOVER, when the oldest became unknown in ms) across all buckets."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for bucket in BUCKETS:
                pipe.zcard(self._index("op-open", bucket))
                pipe.zrange(self._index("op-open", bucket), 0, 0, withscores=True)
            replies = await store.redis_call(pipe.execute())
        count = int(sum(replies[0::2]))
        oldest = [int(first[0][1]) for first in replies[1::2] if first]
        return count, min(oldest) if oldest else None

    async def held_records(self, now_s: float | None = None) -> int:
        """Operation records held in Redis across all buckets: the counts of the hours not yet over and of
        records without a TTL. A record whose TTL ran out this hour is still counted until the hour ends
        (at most an hour of expiries too many); the hours that ended are dropped from the counts here."""
        hour = int((time.time() if now_s is None else now_s) // 3600)
        async with self._redis.pipeline(transaction=False) as pipe:
            for bucket in BUCKETS:
                pipe.hgetall(self._index("op-held", bucket))
            replies = await store.redis_call(pipe.execute())
        total, ended = 0, {}
        for bucket, counts in zip(BUCKETS, replies):
            for slot, count in counts.items():
                name = slot.decode() if isinstance(slot, bytes) else str(slot)
                if name == "p" or (name.isdigit() and int(name) >= hour):
                    total += int(count)
                elif name.isdigit() and int(name) < hour - 1:  # a skewed clock's hour stays one more
                    ended.setdefault(bucket, []).append(name)
        if ended:
            async with self._redis.pipeline(transaction=False) as pipe:
                for bucket, names in ended.items():
                    pipe.hdel(self._index("op-held", bucket), *names)
                await store.redis_call(pipe.execute())
        return max(0, total)


_RESERVED = "r[1] == 'new' or r[1] == 'retry'"  # (Lua) begin reserved the key: what chains after it may run
_RECORDED = "r[1] ~= 'missing'"  # (Lua) the record holds an outcome after a commit: what chains after it may run


class RecordTooLarge(store.StoreError):
    """An operation record larger than ``MAX_RECORD_BYTES``: no proxy wrote it, and nothing of it was read.
    A store fault to a caller without a policy of its own; the readers that hand an outcome back refuse it
    like a record whose MAC does not verify."""


def answer_bound_problem(largest_answer_bytes: int) -> str | None:
    """Why answers of up to ``largest_answer_bytes`` could make records this proxy refuses to read (None: they
    fit). Checked at start, naming the settings."""
    if 2 * largest_answer_bytes + 1024 * 1024 <= MAX_RECORD_BYTES:
        return None
    return (f"backends.max_response_bytes / mcp.upstream_max_answer_bytes: {largest_answer_bytes} bytes; an "
            f"operation record holds up to twice an answer and must stay under {MAX_RECORD_BYTES} bytes: set "
            f"both to at most {(MAX_RECORD_BYTES - 1024 * 1024) // 2}")


def _transition(reply: Any) -> Transition:
    values = tuple(_reply_text(v) if isinstance(v, bytes) else v for v in reply)
    return Transition(str(values[0]), values[1:])


# What a stored text that is not one reads as in a script's answer: no MAC covers it (the record MAC is over
# JSON texts), so an outcome that reads as this is refused like any altered one.
UNREADABLE_TEXT = "\ufffd"


def _reply_text(value: bytes) -> str:
    try:
        return record_text.unpack(value)
    except record_text.PackedTextError:
        return UNREADABLE_TEXT


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:  # e.g. an integer beyond 64 bits in a stored result
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


# A SUCCEEDED record without evidence was settled by its executor's own answer (``_evidence_text``): its
# evidence reads back as this, at the record's ``updated_at`` (when the answer was recorded).
EXECUTOR_SUCCESS = {"source": "executor", "observed": "succeeded"}


def _evidence_text(target: str, evidence: Mapping[str, Any]) -> str:
    """The evidence a commit stores: ``=`` (none: it is derived) for the executor's own success."""
    if target == "SUCCEEDED" and {k: v for k, v in evidence.items() if k != "at_ms"} == EXECUTOR_SUCCESS:
        return "="
    return _dumps(evidence)


def _stored_meta(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the record keeps of a call's meta: no copy of what can be derived, each left out only when its
    derivation gives the same value (``_read_meta`` puts them back):

    - the target's ``args_hash`` is the meta's own;
    - the meta's ``args_hash`` is the digest of the target's arguments when they are shown whole (nothing
      redacted or truncated);
    - ``marks`` (the resources an unknown outcome freezes) are stored as ``true`` when they are the target's
      resources;
    - the ``tenant`` is the record's own field (its scripts index by it without reading the meta)."""
    stored = {k: v for k, v in meta.items() if k != "tenant"}
    target = meta.get("target")
    if not isinstance(target, Mapping):
        return stored
    if "args_hash" in target and target["args_hash"] == meta.get("args_hash"):
        target = {k: v for k, v in target.items() if k != "args_hash"}
        stored["target"] = target
    if "arguments" in target and "args_hash" in stored and digest(target["arguments"]) == stored["args_hash"]:
        del stored["args_hash"]
    if "marks" in stored and stored["marks"] == target.get("resources"):
        stored["marks"] = True
    return stored


def _read_meta(meta: dict[str, Any]) -> dict[str, Any]:
    target = meta.get("target")
    if not isinstance(target, dict):
        return meta
    if "args_hash" not in meta and "arguments" in target:
        meta["args_hash"] = digest(target["arguments"])
    if meta.get("marks") is True:
        meta["marks"] = list(target.get("resources") or ())
    if "args_hash" not in target and "args_hash" in meta:
        meta["target"] = {**target, "args_hash": meta["args_hash"]}
    return meta


def record_fields(reply: list[bytes]) -> dict[str, str]:
    """The fields of a record as ``_READ`` answered (packed, or an earlier version's hash), by long name."""
    if reply[0] == b"p":
        return {LONG_NAMES.get(k, k): v for k, v in unpack_record(reply[1]).items()}
    flat = [v.decode() for v in reply[1:]]
    return dict(zip(flat[0::2], flat[1::2]))


def pack_record(fields: Mapping[str, str | bytes]) -> bytes:
    """A record's stored value: the MessagePack map (short names to strings) the scripts write."""
    out = bytearray()
    _pack_header(out, len(fields), 0x80, 0xDE, 0xDF)
    for name, value in fields.items():
        for text in (FIELDS.get(name, name), value):
            data = text if isinstance(text, bytes) else text.encode()
            if len(data) < 32:
                out.append(0xA0 | len(data))
            elif len(data) < 0x100:
                out += bytes((0xD9, len(data)))
            else:
                _pack_header(out, len(data), None, 0xDA, 0xDB)
            out += data
    return bytes(out)


def _pack_header(out: bytearray, n: int, fix: int | None, head16: int, head32: int) -> None:
    if fix is not None and n < 16:
        out.append(fix | n)
    elif n < 0x10000:
        out += bytes((head16,)) + n.to_bytes(2, "big")
    else:
        out += bytes((head32,)) + n.to_bytes(4, "big")


def unpack_record(data: bytes) -> dict[str, str]:
    """``pack_record`` read back (short names kept): a map of strings, as ``cmsgpack`` packs a Lua table of
    strings; anything else is refused (ValueError), never guessed. A packed text (``record_text``: the meta
    and the outcome) reads as the JSON text it was; one that does not inflate as ``UNREADABLE_TEXT``."""
    at = 0

    def length(fix_base: int, fix_max: int, sized: dict[int, int]) -> int:
        nonlocal at
        head = data[at]
        at += 1
        if fix_base <= head <= fix_max:
            return head - fix_base
        if head in sized:
            size = sized[head]
            value = int.from_bytes(data[at:at + size], "big")
            at += size
            return value
        raise ValueError(f"operation record: unexpected MessagePack type 0x{head:02x}")

    def text() -> str:
        nonlocal at
        n = length(0xA0, 0xBF, {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4})
        value = _reply_text(data[at:at + n])
        at += n
        return value

    if data[:1] == b"\x90":  # an empty table packs as an empty array
        return {}
    count = length(0x80, 0x8F, {0xDE: 2, 0xDF: 4})
    fields = {}
    for _ in range(count):
        name = text()
        fields[name] = text()
    return fields


def _expanded_outcome(text: str | None, state: str, meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record's outcome field, expanded for its state; None when it has none, or holds no JSON (not a
    text this proxy wrote: no MAC covers it, and ``record_verified`` refuses it)."""
    try:
        outcome = json.loads(text) if text else None
    except ValueError:
        return None
    return expand(outcome, OutcomeContext.of_meta(state, meta)) if outcome is not None else None


def _record(key: str, f: Mapping[str, str]) -> Record:

    def num(name: str) -> int | None:
        return int(f[name]) if f.get(name) not in (None, "") else None

    def obj(name: str) -> Mapping[str, Any] | None:
        return json.loads(f[name]) if f.get(name) else None

    meta = _read_meta(obj("meta") or {})
    if "tenant" in f:
        meta = {"tenant": f["tenant"], **meta}
    state = f.get("state", "ABSENT")
    return Record(
        key=key, state=state, attempt=num("attempt") or 0, token=num("token") or 0,
        is_write=f.get("is_write") == "1", meta=meta, created_at=num("created_at") or 0,
        updated_at=num("updated_at") or 0, retention_s=num("retention") or 0, lease_until=num("lease_until"),
        outcome=_expanded_outcome(f.get("outcome"), state, meta),
        evidence=obj("evidence") or ({**EXECUTOR_SUCCESS, "at_ms": num("updated_at")} if state == "SUCCEEDED" else None),
        final_reason=f.get("final_reason") or None,
        unknown_since=num("unknown_since"), reconcile_until=num("rec_until"), reconcile_next=num("rec_next"),
        reconcile_attempts=num("rec_attempts") or 0, takeover_at=num("takeover_at"),
        owner=f.get("owner") or None, cancel=obj("cancel"), compensation=obj("compensation"),
        fingerprint=f.get("fp", ""), outcome_text=f.get("outcome", ""), outcome_mac=f.get("omac") or None,
        meta_text=f.get("meta", ""), meta_mac=f.get("mmac") or None)
