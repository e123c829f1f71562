"""Argument provenance: where the values aiming a call (its sink arguments) came from.

A contract names the arguments that aim its call (``flow.sink_arguments``: a recipient, a URL, an IBAN, a
file id, a hotel). After a call of a tool whose output a third party may have written (``flow.produces``
has ``untrusted``) or whose output is the user's own records (``flow.trusted_source``), the proxy keeps,
per principal, keyed fingerprints of the tokens that output held: whole short string values, and inside
longer text the addresses, URLs and their hosts, IBANs, id-like words, identifiers, quoted strings and
capitalized names. A later call's sink-argument values are fingerprinted the same way and looked up: a value seen
only in untrusted output is reported with the sources (tool, call id, time) that brought it; a value also
seen in a trusted source, or named by the caller's trusted task context, is trusted.

Everything here is bounded: tokens per output (``MAX_TOKENS``; more sets the output's overflow mark, so
nothing an attacker pushed past the bound goes unseen), characters scanned per output, a token's length,
sink values per call. Fingerprints are HMAC-SHA256 under a key derived from the record MAC key, cut to
128 bits: a reader of Redis learns neither the values nor, without the key, can test a guess.

A contract may also name payload arguments (``flow.payload_arguments``: a body, a title): each link in them
and each short text as a whole are looked up the same way (``input.flow.payload``): a phishing link, or a
third party's words relayed verbatim. A directory's output (``flow.directory``: a member or channel list)
has its whole entries remembered apart (field ``d<fp>``), so a sink value that is an existing entry says so.

Owns: the normalization of a value, token extraction, fingerprints, the sink- and payload-argument paths of
a contract and the values at them, a directory's entries, the trusted task context's tokens, and the
``input.flow.provenance`` and ``input.flow.payload`` entries.
Must never: keep or return a raw value outside the process (fingerprints only), call Redis (proxy/flow.py
does, in its existing round trips), or trust a value because the model or a tool's output says so.
"""

from __future__ import annotations

import binascii
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from .envelope import iso

MAX_TOKENS = 512          # distinct tokens kept per output; more: the output's overflow mark is set
MAX_TOKEN_CHARS = 200     # a whole string value longer than this is scanned for tokens, not kept whole
MAX_SCAN_CHARS = 262144   # characters of one output's strings scanned; past it: the overflow mark
MAX_SINK_VALUES = 32      # sink-argument values looked up per call; more: the rest are reported unseen-overflow
MAX_DEPTH = 32            # nesting walked in an output or an argument
MIN_TOKEN_CHARS = 2

OVERFLOW = "!over"        # the field of a scope whose bound was reached (proxy/flow.py)

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})+")
_URL = re.compile(r"(?:https?://|www\.)[^\s<>\"'()\[\]{}]{1,300}", re.IGNORECASE)
_IBAN = re.compile(r"\b[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b")
_QUOTED = re.compile(r"'([^'\n]{2,200})'|\"([^\"\n]{2,200})\"|\u201c([^\u201d\n]{2,200})\u201d")
_DIGIT = re.compile(r"[0-9]")
_EDGE = ".,;:!?\"'()<>[]{}`*\u201c\u201d\u2018\u2019"


def normalize(text: str) -> str:
    """A value as compared: NFKC, case-folded, inner whitespace collapsed, edge punctuation stripped."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    return " ".join(text.split()).strip(_EDGE).strip().casefold()


def _host(url: str) -> str | None:
    text = url if "://" in url else "http://" + url
    try:
        host = urlsplit(text).hostname
    except ValueError:
        return None
    if not host:
        return None
    return host[4:] if host.startswith("www.") else host


_TLDS = frozenset("com org net io ai co dev app info biz me uk de fr eu us ch it es nl ru cn xyz site online top "
                  "link shop store edu gov".split())
_CONNECTORS = frozenset("of the de la von van and & du di da del le".split())
_IBAN_HEAD = re.compile(r"[A-Z]{2}[0-9]{2}")
_IBAN_GROUP = re.compile(r"[A-Z0-9]{1,4}")
_PLAIN = re.compile(r"[A-Za-z0-9_-]+")  # one word, no address, URL or host in it
MAX_NAME_WORDS = 6
_CLAUSE_END = ".,;:!?)\"'"   # a word ending so ends the name it is in (a sentence or a clause ends there)


def text_tokens(text: str) -> Iterable[str]:
    """The tokens of one string: itself when short, and what a target looks like inside it (not normalized).
    One pass over its whitespace-separated words (linear on any text, an attacker's included)."""
    if len(text) <= MAX_TOKEN_CHARS and (text.isalnum() or (text.isascii() and _PLAIN.fullmatch(text))):
        return (text,)  # an id or a word: itself only (most values of a JSON output)
    return _scanned(text)


def _scanned(text: str) -> Iterator[str]:
    """``text_tokens`` of a string that is not one short word."""
    if len(text) <= MAX_TOKEN_CHARS:
        yield text
    words = text.split()
    run: list[str] = []  # consecutive Capitalized words (with connectors inside): a name
    for index, raw in enumerate(words):
        if raw.isalpha() and raw.islower():  # most of prose: a plain word
            ends_name = _plain_word_ends_name(run, raw)
        else:
            word = raw.strip(_EDGE)
            if not word or len(word) > MAX_TOKEN_CHARS:  # (no target is that long: a blob is skipped whole)
                ends_name = True
            else:
                yield from _word_targets(word, words, index)
                ends_name = _word_ends_name(run, raw, word)
        if ends_name:
            yield from _names(run)
            run = []
    yield from _names(run)
    for match in _QUOTED.finditer(text):
        yield next(g for g in match.groups() if g)


def _plain_word_ends_name(run: list[str], raw: str) -> bool:
    """Whether a plain lower-case word ends the name being read; a connector inside a name joins it (``run``)."""
    if raw not in _CONNECTORS:
        return True
    if run:
        run.append(raw)
    return False


def _word_ends_name(run: list[str], raw: str, word: str) -> bool:
    """Whether ``word`` (``raw`` without its edge punctuation) ends the name being read: a Capitalized word
    or a connector inside a name joins it (``run``), and the name ends where a sentence or a clause does or
    when it is too long to be one."""
    if not (word[0].isupper() or (run and word in _CONNECTORS)):
        return True
    run.append(word)
    return raw[-1:] in _CLAUSE_END or len(run) >= 2 * MAX_NAME_WORDS


def _word_targets(word: str, words: list[str], index: int) -> Iterator[str]:
    """What a target looks like in one word (``words[index]`` without its edge punctuation): an address, a
    URL or a host and what they name, an identifier, a word with digits and an IBAN written in groups from it."""
    yield from _address_or_link(word)
    if "_" in word or (word[1:] != word[1:].lower() and word[1:] != word[1:].upper()):
        yield word  # an identifier (new_password, newPassword): a value a target or a secret can take
    if _DIGIT.search(word):  # ids, numbers, IBANs written whole
        yield word
        if _IBAN_HEAD.fullmatch(word):  # an IBAN in groups: "GB29 NWBK 6016 1331 9268 19"
            yield from _grouped_iban(word, words[index + 1:index + 9])


def _address_or_link(word: str) -> Iterator[str]:
    """An address in the word and its domain, or the word as a URL and its host, or the word as a host name."""
    if "@" in word:
        match = _EMAIL.search(word)
        if match:
            yield match.group(0)
            yield match.group(0).rpartition("@")[2]
    elif "://" in word or word[:4].lower() == "www.":
        yield word
        host = _host(word)
        if host:
            yield host
    elif "." in word and word.rpartition(".")[2].lower() in _TLDS:
        yield word


def _grouped_iban(head: str, following: list[str]) -> Iterator[str]:
    """The IBAN whose first group is ``head``, written whole from the groups in the words following it (an
    IBAN has at most eight groups after its first; a short group is its last)."""
    groups = [head]
    for nxt in following:
        part = nxt.strip(_EDGE)
        if not _IBAN_GROUP.fullmatch(part):
            break
        groups.append(part)
        if len(part) < 4:
            break
    if len(groups) >= 3:
        yield "".join(groups)


def _names(run: list[str]) -> Iterator[str]:
    """A run of Capitalized words as names: the whole run and each of its prefixes and suffixes of two words
    or more (a sentence's first word is capitalized too: "Book Riverside View Hotel"), connectors trimmed."""
    end = len(run)
    while end and run[end - 1] in _CONNECTORS:  # (lower-case ones only: "Le Marais" is a name)
        end -= 1  # (one slice below, not one per connector: a long run of them stays linear)
    if end < 2:
        return
    run = run[max(0, end - MAX_NAME_WORDS):end]
    for cut in range(len(run) - 1):
        tail = run[cut:]
        if tail[0] not in _CONNECTORS:
            yield " ".join(tail)
    for cut in range(2, len(run)):
        head = run[:cut]
        if head[-1] not in _CONNECTORS:
            yield " ".join(head)


def value_candidates(value: str) -> list[str]:
    """The normalized forms a sink value is looked up by: the whole value first, then, for a URL, its host (a
    page that names a site names every URL on it), for an IBAN written in groups, its compact form. An address
    is looked up whole only: a domain the user's own contacts share must not clear it."""
    text = value.strip()
    whole = normalize(text)
    found = [whole] if whole else []
    if _URL.match(text) or text.lower().startswith(("http://", "https://")):
        host = _host(text)
        if host and normalize(host) not in found:
            found.append(normalize(host))
    compact = whole.replace(" ", "")
    if compact != whole and _IBAN.fullmatch(text.upper()):
        found.append(compact)
    return [c[:MAX_TOKEN_CHARS] for c in found]


@dataclass(frozen=True)
class Extracted:
    """The normalized tokens of one output; ``overflow``: a bound cut it short (tokens, scanned text)."""

    tokens: tuple[str, ...]
    overflow: bool


def extract(output: Any) -> Extracted:
    """The distinct normalized tokens of a tool's output (strings and numbers anywhere in it), bounded."""
    seen: dict[str, None] = {}
    raw_seen: set[str] = set()  # a repeated token is normalized once (a page repeats its words)
    budget = MAX_SCAN_CHARS
    overflow = False
    for leaf in _leaves(output, 0):
        if isinstance(leaf, str):
            if budget <= 0:
                overflow = True
                break
            text = leaf[:budget]
            overflow = overflow or len(text) < len(leaf)
            budget -= len(text)
            raw: Iterable[str] = text_tokens(text)
        else:
            raw = (str(leaf),)
        for token in raw:
            if token in raw_seen:
                continue
            raw_seen.add(token)
            norm = normalize(token)
            if MIN_TOKEN_CHARS <= len(norm) <= MAX_TOKEN_CHARS or (norm.isdigit() and norm):
                if norm not in seen:
                    if len(seen) >= MAX_TOKENS:
                        return Extracted(tuple(seen), True)
                    seen[norm] = None
    return Extracted(tuple(seen), overflow)


def _leaves(value: Any, depth: int) -> Iterator[Any]:
    """The strings and numbers in ``value`` in document order, down to ``MAX_DEPTH`` (a float that is a whole
    number as an int; booleans and nulls are no values). A generator per container, not per value."""
    if depth > MAX_DEPTH:
        return
    kind = type(value)
    if kind is dict:
        subs: Iterable[Any] = value.values()
    elif kind is list:
        subs = value
    else:
        leaf = _leaf(value)
        if leaf is not None:
            yield leaf
            return
        if isinstance(value, Mapping):
            subs = value.values()
        elif isinstance(value, (list, tuple)):
            subs = value
        else:
            return
    if depth == MAX_DEPTH:  # what it holds is past the bound
        return
    for sub in subs:
        kind = type(sub)
        if kind is str or kind is int:
            yield sub
        else:
            yield from _leaves(sub, depth + 1)


def _leaf(value: Any) -> Any:
    """A string or a number as a value (None for anything else: a container, a boolean, a null)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or not value.is_integer() else int(value)


_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))
_URLSAFE = bytes.maketrans(b"+/", b"-_")


class Fingerprints:
    """Keyed fingerprints of normalized tokens (one instance per process: the key is the MAC key's):
    HMAC-SHA256 cut to 128 bits, URL-safe base64 without padding (22 characters). The HMAC's keyed inner
    and outer hash states are made once and copied per token (RFC 2104, as ``hmac`` does): a one-shot
    ``hmac.digest`` keys both again for every token, about half of a short token's fingerprint."""

    def __init__(self, key: bytes) -> None:
        block = hashlib.sha256().block_size
        if len(key) > block:
            key = hashlib.sha256(key).digest()
        key = key.ljust(block, b"\0")
        self._inner = hashlib.sha256(key.translate(_IPAD))
        self._outer = hashlib.sha256(key.translate(_OPAD))

    def of(self, token: str) -> str:
        inner = self._inner.copy()
        inner.update(token.encode("utf-8", "surrogatepass"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return binascii.b2a_base64(outer.digest()[:16], newline=False)[:22].translate(_URLSAFE).decode("ascii")


# ---- sink arguments ------------------------------------------------------------------------------------------

def pointer(path: str) -> str:
    """A contract's sink-argument path as a JSON pointer ("recipient" -> "/recipient")."""
    return path if path.startswith("/") else "/" + path.replace("~", "~0").replace("/", "~1")


@lru_cache(maxsize=1024)
def _parts(path: str) -> tuple[str, ...]:
    """A sink-argument path's property names (a contract's paths are few: each is split once)."""
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in pointer(path).split("/")[1:])


def schema_problem(path: str, input_schema: Mapping[str, Any]) -> str | None:
    """Why ``path`` does not name an argument the input schema declares (None: it does; arrays are walked)."""
    schema: Any = input_schema
    for part in _parts(path):
        while isinstance(schema, Mapping) and schema.get("type") == "array" and isinstance(schema.get("items"),
                                                                                           Mapping):
            schema = schema["items"]
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        if not isinstance(properties, Mapping) or part not in properties:
            return f"{path!r}: {part!r} is not a property of inputSchema there"
        schema = properties[part]
    return None


@dataclass(frozen=True)
class SinkValue:
    argument: str                 # a JSON pointer to the value itself ("/recipients/1")
    candidates: tuple[str, ...]   # its normalized lookup forms, the whole value first
    link: bool | None = None      # a payload's value: a link in it (True) or its text whole (False)


def sink_values(arguments: Mapping[str, Any], paths: Sequence[str]) -> tuple[tuple[SinkValue, ...], bool]:
    """The string and number values at the sink-argument paths (arrays walked element by element, objects
    by their leaves), at most ``MAX_SINK_VALUES``; the flag says some were left out."""
    found: list[SinkValue] = []
    for path in paths:
        for where, value in _at(arguments, _parts(path), "", 0):
            if len(found) >= MAX_SINK_VALUES:
                return tuple(found), True
            text = value if isinstance(value, str) else str(value)
            # a value that normalizes to nothing is still a target set (unseen), never an absent one
            found.append(SinkValue(where, tuple(value_candidates(text)) or ("",)))
    return tuple(found), False


def payload_values(arguments: Mapping[str, Any], paths: Sequence[str]) -> tuple[tuple[SinkValue, ...], bool]:
    """What a payload (free text: a body, a title) is looked up by: each text short enough to be a token as a
    whole (a third party's words relayed verbatim), and each link in it (an address, a URL and its host, a
    host name), at most ``MAX_SINK_VALUES`` in all and ``MAX_SCAN_CHARS`` of text scanned; the flag says some
    were left out. A payload's other words are the agent's to compose: never looked up."""
    if not paths:  # (most contracts name none)
        return (), False
    found: dict[tuple[str, tuple[str, ...]], None] = {}
    budget = MAX_SCAN_CHARS
    for path in paths:
        for where, value in _at(arguments, _parts(path), "", 0):
            text = value if isinstance(value, str) else str(value)
            if len(text) > budget:
                return _bounded(found), True
            budget -= len(text)
            for candidates in _payload_candidates(text):
                found[(where, candidates)] = None
                if len(found) > MAX_SINK_VALUES:
                    return _bounded(found), True
    return _bounded(found), False


def _bounded(found: Mapping[tuple[str, tuple[str, ...]], None]) -> tuple[SinkValue, ...]:
    return tuple(SinkValue(where, candidates, link=" " not in candidates[0])
                 for where, candidates in list(found)[:MAX_SINK_VALUES])


def _payload_candidates(text: str) -> Iterator[tuple[str, ...]]:
    """One text's lookups: itself whole when short (and more than a word: a one-word body is no one's
    words), then each link in it."""
    whole = normalize(text)
    if len(text) <= MAX_TOKEN_CHARS and " " in whole:
        yield (whole,)
    for raw in text.split():
        word = raw.strip(_EDGE)
        if len(word) <= MAX_TOKEN_CHARS and ("@" in word or "." in word):
            # the address whole (its domain is its neighbours' too), the URL with its host, or the host
            link = next(_address_or_link(word), None)
            candidates = tuple(value_candidates(link)) if link else ()
            if candidates:
                yield candidates


def directory_entries(output: Any, paths: Sequence[str] = ("",)) -> tuple[str, ...]:
    """The whole entries of a directory's output (``flow.directory``: a member or channel list; or the fields
    at ``paths``, arrays walked, that the platform sets to an existing member: a message's sender): its short
    string leaves, normalized, at most ``MAX_TOKENS``. No paths: none."""
    found: dict[str, None] = {}
    for leaf in (leaf for path in paths for leaf in _directory_leaves(output, path)):
        if isinstance(leaf, str) and len(leaf) <= MAX_TOKEN_CHARS:
            norm = normalize(leaf)
            if norm:
                found[norm] = None
                if len(found) >= MAX_TOKENS:
                    break
    return tuple(found)


def _directory_leaves(output: Any, path: str) -> Iterator[Any]:
    if not path:
        yield from _leaves(output, 0)
    else:
        yield from (value for _, value in _at(output, _parts(path), "", 0))


def _at(value: Any, parts: Sequence[str], where: str, depth: int) -> Iterator[tuple[str, Any]]:
    if depth > MAX_DEPTH:
        return
    if isinstance(value, list):
        for index, sub in enumerate(value):
            yield from _at(sub, parts, f"{where}/{index}", depth + 1)
        return
    if parts:
        if _is_mapping(value) and parts[0] in value:
            name = parts[0].replace("~", "~0").replace("/", "~1")
            yield from _at(value[parts[0]], parts[1:], f"{where}/{name}", depth + 1)
        return
    if _is_mapping(value):
        for key, sub in value.items():
            yield from _at(sub, [], f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}", depth + 1)
    elif isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        yield where, value


def _is_mapping(value: Any) -> bool:
    """Whether ``value`` is an object (a dict first: an ABC's check costs a Python call, and a string is none)."""
    return type(value) is dict or (type(value) is not str and isinstance(value, Mapping))


# ---- the trusted task context -------------------------------------------------------------------------------

MAX_TASK_CHARS = 16384
MAX_TASK_VALUES = 64


@dataclass(frozen=True)
class TaskContext:
    """What the user asked, from a channel the agent's model cannot write (proxy/identity.py): the normalized
    tokens of the task text and of the values the user named. Held in memory for the call only."""

    tokens: frozenset[str] = field(default_factory=frozenset, repr=False)

    def names(self, candidates: Sequence[str]) -> bool:
        return bool(candidates) and candidates[0] in self.tokens


@lru_cache(maxsize=256)
def task_context(text: str, values: tuple[str, ...]) -> TaskContext:
    """The task context of a claim or header: its text's tokens and its named values, bounded."""
    tokens = set(extract(text[:MAX_TASK_CHARS]).tokens)
    for value in values[:MAX_TASK_VALUES]:
        tokens.update(value_candidates(value[:MAX_TOKEN_CHARS])[:1])
        tokens.update(extract(value[:MAX_TOKEN_CHARS]).tokens)
    return TaskContext(frozenset(t for t in tokens if t))


def task_context_from(raw: Any) -> TaskContext | None:
    """A claim's or header's task context: a string (the task text) or {"text": str, "values": [str]}; None
    when absent or of another shape (nothing is trusted then)."""
    if isinstance(raw, str) and raw.strip():
        return task_context(raw, ())
    if isinstance(raw, Mapping):
        text = raw.get("text") if isinstance(raw.get("text"), str) else ""
        values = raw.get("values") if isinstance(raw.get("values"), list) else []
        named = tuple(v if isinstance(v, str) else str(v) for v in values
                      if isinstance(v, (str, int)) and not isinstance(v, bool))
        if text or named:
            return task_context(text, named)
    return None


# ---- what OPA is given --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    tool: str
    call_id: str
    at_ms: int

    @staticmethod
    def parse(stored: Any) -> "Source | None":
        """A stored ``<at_ms>|<tool>|<call id>`` (None when it is not one: never trusted)."""
        text = stored.decode("utf-8", "replace") if isinstance(stored, bytes) else stored
        if not isinstance(text, str):
            return None
        at, _, rest = text.partition("|")
        tool, _, call_id = rest.partition("|")
        if not at.isdigit() or not tool:
            return None
        return Source(tool, call_id, int(at))

    def stored(self) -> str:
        return f"{self.at_ms}|{self.tool}|{self.call_id}"


DIRECTORY = "d"  # the field prefix of a directory's whole entries ("u": untrusted tokens, "t": trusted ones)


@dataclass(frozen=True)
class Lookup:
    """What one call looks up: its sink values (with ``directory``, also whether each is an existing entry of
    a directory: a state_changing internal write) and its payload values; ``truncated``/``payload_truncated``:
    a bound left some out."""

    values: tuple[SinkValue, ...] = ()
    payload: tuple[SinkValue, ...] = ()
    directory: bool = False
    truncated: bool = False
    payload_truncated: bool = False

    def fields(self, fingerprints: Fingerprints) -> list[str]:
        """The hash fields a read asks for: per candidate its untrusted then its trusted field (and, for a
        sink value under ``directory``, its whole value's directory field), payload values alike, then the
        overflow mark (proxy/flow.py's read script)."""
        fields = []
        for value in self.values:
            fields += _value_fields(value, fingerprints, self.directory)
        for value in self.payload:
            fields += _value_fields(value, fingerprints, False)
        return fields + [OVERFLOW]

    def provenance(self, replies: Sequence[Any], *, task: TaskContext | None, now_ms: int, window_ms: int
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``input.flow.provenance`` and ``input.flow.payload`` from the read's replies to ``fields``."""
        overflow = _fresh(replies[-1], now_ms, window_ms) if replies else None
        sinks, at = _entries(self.values, self.directory, replies, 0, task, overflow, now_ms, window_ms)
        payload = _entries(self.payload, False, replies, at, task, overflow, now_ms, window_ms)[0] \
            if self.payload else []
        if self.truncated:
            sinks.append(_past_bound(now_ms))
        if self.payload_truncated:
            payload.append(_past_bound(now_ms))
        return sinks, payload


def _entries(values: Sequence[SinkValue], directory: bool, replies: Sequence[Any], at: int,
             task: TaskContext | None, overflow: Source | None, now_ms: int, window_ms: int
             ) -> tuple[list[dict[str, Any]], int]:
    """The entries of ``values`` from the replies from ``at`` on (``Lookup.fields``' order), and where the
    next value's replies start."""
    out = []
    for value in values:
        width = 2 * len(value.candidates) + (1 if directory else 0)
        found = [_fresh(replies[index], now_ms, window_ms) for index in range(at, at + width)]
        at += width
        out.append(_entry(value, found, task, overflow, directory))
    return out, at


MAX_PREPARED = 1024  # calls' lookups a ``Lookups`` keeps


class Lookups:
    """What calls look up under one process key (``fingerprints``), and the hash fields each asks for
    (``Lookup.fields``). A call whose every sink and payload argument is a top-level string of at most
    ``MAX_TOKEN_CHARS``, an integer, null or a list of them is remembered (at most ``bound`` calls, the oldest
    dropped first) under those values: the same values give the same lookup and, under the key, the same
    fingerprints (an agent aims at the same few targets again and again). Its values stay in the process's
    memory, like any call's arguments; only fingerprints leave it."""

    def __init__(self, fingerprints: Fingerprints, bound: int = MAX_PREPARED) -> None:
        self._fingerprints = fingerprints
        self._bound = bound
        self._prepared: dict[tuple[Any, ...], tuple[Lookup, tuple[str, ...]]] = {}  # the oldest first

    def __len__(self) -> int:
        return len(self._prepared)

    def of(self, arguments: Mapping[str, Any], sink_paths: tuple[str, ...], payload_paths: tuple[str, ...], *,
           directory: bool) -> tuple[Lookup, tuple[str, ...]]:
        values = _plain_values(arguments, sink_paths + payload_paths)
        key = (sink_paths, payload_paths, directory, values)
        if values is not None:
            known = self._prepared.get(key)
            if known is not None:
                return known
        found, truncated = sink_values(arguments, sink_paths)
        payload, cut = payload_values(arguments, payload_paths)
        lookup = Lookup(found, payload, directory=directory, truncated=truncated, payload_truncated=cut)
        prepared = lookup, tuple(lookup.fields(self._fingerprints))
        if values is not None:
            if len(self._prepared) >= self._bound:
                self._prepared.pop(next(iter(self._prepared)), None)
            self._prepared[key] = prepared
        return prepared


def _plain_values(arguments: Mapping[str, Any], paths: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The values at ``paths`` as a key, when each path names a top-level argument that is absent, null, a
    short string, an integer or a list of those (a list as a tuple: absent and null alike, as the paths' walk
    skips both); None for anything else (an object, a float or a boolean, a nested path, a longer text: looked
    up every time)."""
    if type(arguments) is not dict:
        return None
    found = []
    for path in paths:
        parts = _parts(path)
        if len(parts) != 1:
            return None
        value = arguments.get(parts[0])
        kind = type(value)
        if kind is str:
            if len(value) > MAX_TOKEN_CHARS:
                return None
        elif kind is list:
            if len(value) > MAX_SINK_VALUES or not all(map(_plain, value)):
                return None
            value = tuple(value)
        elif value is not None and kind is not int:
            return None
        found.append(value)
    return tuple(found)


def _plain(value: Any) -> bool:
    kind = type(value)
    return value is None or kind is int or (kind is str and len(value) <= MAX_TOKEN_CHARS)


def _value_fields(value: SinkValue, fingerprints: Fingerprints, directory: bool) -> list[str]:
    fields = []
    for candidate in value.candidates:
        fp = fingerprints.of(candidate)
        fields += ["u" + fp, "t" + fp]
    return fields + ([DIRECTORY + fingerprints.of(value.candidates[0])] if directory else [])


def lookup_fields(values: Sequence[SinkValue], fingerprints: Fingerprints) -> list[str]:
    """The hash fields a read asks for sink values alone (``Lookup.fields``)."""
    return Lookup(tuple(values)).fields(fingerprints)


def entries(values: Sequence[SinkValue], replies: Sequence[Any], *, task: TaskContext | None, now_ms: int,
            window_ms: int, truncated: bool = False) -> list[dict[str, Any]]:
    """``input.flow.provenance``: one entry per sink value, from the read's replies to ``lookup_fields``."""
    return Lookup(tuple(values), truncated=truncated).provenance(replies, task=task, now_ms=now_ms,
                                                                 window_ms=window_ms)[0]


def _past_bound(now_ms: int) -> dict[str, Any]:
    """The entry standing for the values past a bound: untrusted (nothing past it goes unseen)."""
    return {"argument": "(past the sink values' bound)", "seen": "untrusted", "trusted": False, "trusted_by": [],
            "untrusted_sources": [{"tool": "(too many sink values)", "call_id": "", "at": iso(now_ms / 1000)}]}


@lru_cache(maxsize=MAX_PREPARED)
def _stored_source(stored: bytes) -> Source | None:
    """``Source.parse`` of a stored field as Redis returns it (a source is read again and again until its
    value is seen anew: the same bytes, the same immutable Source)."""
    return Source.parse(stored)


def _fresh(stored: Any, now_ms: int, window_ms: int) -> Source | None:
    """The source a stored field names, when it is one and inside the window (None otherwise)."""
    if stored is None:  # (most fields are absent)
        return None
    source = _stored_source(stored) if type(stored) is bytes and len(stored) <= 512 else Source.parse(stored)
    return source if source is not None and now_ms - source.at_ms < window_ms else None


def _entry(value: SinkValue, found: Sequence[Source | None], task: TaskContext | None,
           overflow: Source | None, directory: bool = False) -> dict[str, Any]:
    """One value's entry; ``found``: the fresh sources at its candidates' untrusted and trusted fields, in
    ``Lookup.fields``' order (then, with ``directory``, at its directory field); ``overflow``: the fresh
    overflow mark of the scope."""
    trusted_by = ["task_context"] if task is not None and task.names(value.candidates) else []
    if found[1:2] and found[1] is not None:  # a trusted source names the whole value
        trusted_by.append(f"tool:{found[1].tool}")
    pairs = found[:2 * len(value.candidates)]
    untrusted: list[Source] = []
    for bad in pairs[0::2]:
        if bad is not None and bad not in untrusted:
            untrusted.append(bad)
    if not trusted_by and not untrusted and overflow is not None:
        untrusted.append(overflow)  # the scope lost values past its bound: unseen is not clean
    fact = _entry_fact(value.argument, trusted_by, untrusted)
    if value.link is not None:
        fact["form"] = "link" if value.link else "text"
    listed = found[-1] if directory else None
    if listed is not None:  # an existing entry of a directory (the organisation's member or channel list)
        fact["directory"] = {"tool": listed.tool, "call_id": listed.call_id}
    return fact


def _entry_fact(argument: str, trusted_by: list[str], untrusted: list[Source]) -> dict[str, Any]:
    """An entry as OPA is given it: trusted when anything trusted names the value, untrusted when only
    untrusted sources do, unseen otherwise (``trusted_by`` becomes the entry's: a list of its own)."""
    trusted = bool(trusted_by)
    return {"argument": argument,
            "seen": "trusted" if trusted else "untrusted" if untrusted else "unseen",
            "trusted": trusted, "trusted_by": sorted(set(trusted_by)) if len(trusted_by) > 1 else trusted_by,
            "untrusted_sources": [{"tool": s.tool, "call_id": s.call_id, "at": iso(s.at_ms / 1000.0)}
                                  for s in untrusted]}
