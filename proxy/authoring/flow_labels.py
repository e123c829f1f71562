"""Proposed flow labels: which outputs hold text others wrote, which arguments aim a call.

A label left off is a channel left open: a prompt injection arrives wherever a third party can write
(a mail's body or sender, a review, a shared document's text, an invitation's description), and a
rule over labels is only as good as the labels covering those channels. This module reads a tool's
schemas and description the way a reviewer would and proposes: ``untrusted`` for an output with
fields others write, ``sink_arguments`` for arguments named like a target (recipient, URL, IBAN,
file id, participant, hotel). ``import-mcp`` writes the proposals into its draft for review;
``check-registry`` warns about a contract whose output looks written by others but is not labelled.

Owns: the name patterns and the walk over schemas that finds them.
Must never: decide a label on its own (a person reviews every proposal), or read anything but the
registry's or the upstream's declared schemas and description.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping

# Output fields a third party usually writes (split on camelCase and separators before matching).
_WRITTEN_BY_OTHERS = re.compile(
    r"(^|_)(body|content|contents|text|message|messages|comment|comments|review|reviews|snippet|html|markdown|"
    r"note|notes|sender|from|author|reply|replies|post|posts|page|transcript|bio|feedback|caption|chat|"
    r"thread|email|emails|mail|inbox|document|webpage|article)(_|$)", re.I)
_AN_ID = re.compile(r"_(id|ids|count|at|url)$")  # ids, counters and times are the system's, not prose
# Descriptions that say the output is others' words (a tool without an outputSchema says nothing else).
_DESCRIBES_OTHERS = re.compile(
    r"\b(e-?mails?|inbox|messages?|web ?pages?|websites?|urls?|reviews?|comments?|posts?|articles?|"
    r"documents?|files?|search results?|chat|channel|slack|calendar|events?|tickets?|issues?|written by|"
    r"third[- ]party|user-generated)\b", re.I)
# Argument names that aim a call at a target.
_TARGET = re.compile(
    r"(^|_)(to|cc|bcc|recipient|recipients|email|emails|address|url|urls|uri|link|href|endpoint|webhook|iban|"
    r"account|destination|target|participant|participants|attendee|attendees|invitee|invitees|user|users|"
    r"username|channel|phone|hotel|restaurant|company|domain|host|file_id|document_id|path|repo|repository|"
    r"payee|beneficiary)(_|$)", re.I)
MAX_FIELDS = 200  # schema nodes walked per tool (an upstream's schema is not trusted to be small)


def _words(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).replace("-", "_").lower()


def others_fields(output_schema: Any) -> list[str]:
    """The output schema's property paths whose names say a third party writes them (dotted, bounded)."""
    found: list[str] = []
    for path, name in _properties(output_schema, ""):
        if _WRITTEN_BY_OTHERS.search(_words(name)) and not _AN_ID.search(_words(name)):
            found.append(path)
    return found


def target_arguments(input_schema: Any) -> list[str]:
    """The input schema's property paths (JSON pointers; arrays walked) named like a call's target."""
    return [("/" + path.replace(".", "/")) for path, name in _properties(input_schema, "")
            if _TARGET.search(_words(name)) and not any(c in path for c in "/~")]


def describes_others(description: str) -> bool:
    return bool(_DESCRIBES_OTHERS.search(description or ""))


def _properties(schema: Any, where: str, budget: list[int] | None = None) -> Iterator[tuple[str, str]]:
    budget = budget if budget is not None else [MAX_FIELDS]
    if not isinstance(schema, Mapping) or budget[0] <= 0:
        return
    while isinstance(schema.get("items"), Mapping):  # an array: its items' properties
        schema = schema["items"]
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return
    for name, sub in properties.items():
        budget[0] -= 1
        if budget[0] < 0 or not isinstance(name, str):
            return
        path = f"{where}.{name}" if where else name
        yield path, name
        yield from _properties(sub, path, budget)


def proposal(*, description: str, input_schema: Any, output_schema: Any) -> tuple[dict[str, Any], list[str]]:
    """The flow facts a reviewer should consider for a tool, and why (one note each)."""
    flow: dict[str, Any] = {}
    notes = []
    fields = others_fields(output_schema) if isinstance(output_schema, Mapping) else []
    if fields:
        flow["produces"] = ["untrusted"]
        notes.append(f"flow.produces: untrusted proposed: the output has fields others usually write "
                     f"({', '.join(fields[:8])}); a prompt injection arrives through them. Drop it only if "
                     f"nobody but your own company writes them; use flow.trusted_source for the user's own "
                     f"records.")
    elif not output_schema and describes_others(description):
        flow["produces"] = ["untrusted"]
        notes.append("flow.produces: untrusted proposed: no outputSchema, and the description speaks of content "
                     "others write (mail, pages, reviews, files...).")
    else:
        notes.append("flow.produces: none proposed; label the output untrusted if anyone outside your company "
                     "can write any of it, private if it holds a person's data.")
    targets = target_arguments(input_schema)
    if targets:
        flow["sink_arguments"] = targets
        flow["integrity"] = "destructive"  # the draft's fail-safe default risk: its targets are guarded
        notes.append(f"flow.sink_arguments: proposed from the argument names ({', '.join(targets)}): the values "
                     f"that aim the call; a value the agent saw only in untrusted output waits for a person. "
                     f"flow.integrity: destructive goes with the draft's default risk; for a read drop both, and "
                     f"set flow.sink: external if these arguments leave the company.")
    return flow, notes


def unlabelled_others(tools: Iterable[Any]) -> list[str]:
    """check-registry's warnings: contracts whose output looks written by others but is not labelled
    untrusted (nor declared the user's own records)."""
    found = []
    for tool in tools:
        if "untrusted" in tool.flow_produces or tool.flow_trusted_source:
            continue
        fields = others_fields(tool.output_schema) if tool.output_schema else []
        if fields:
            found.append(f"{tool.name} {tool.version} ({tool.source}): its output has fields others usually write "
                         f"({', '.join(fields[:5])}) but flow.produces does not say untrusted: a prompt injection "
                         f"in them reaches the model unlabelled (label it, or set flow.trusted_source if only "
                         f"the user writes them)")
        elif not tool.output_schema and tool.is_write is False and describes_others(tool.description):
            found.append(f"{tool.name} {tool.version} ({tool.source}): no outputSchema, and its description speaks of content "
                         f"others write, but flow.produces does not say untrusted")
    return found
