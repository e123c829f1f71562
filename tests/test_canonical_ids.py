"""Canonical resource ids: a template declares the canonical form of the arguments it names (Unicode normal
form, case, aliases, time notation, pattern), and the proxy applies it before anything derives from them, so
two spellings of one mailbox (composed or decomposed accents, other case), two notations of one instant and
an alias of a report are each one lock, one freeze, one operation key and one object at the backend. Real
OPA, Redis and demo backend; effects counted there."""

from __future__ import annotations

import asyncio
import unicodedata
import uuid

import pytest

from proxy.registry import RegistryError, load_registry
from proxy.process.registry_reload import files_digest
from tests.support.stack import DEMO_REGISTRY, extra_tools, running_stack
from tests.support.waits import wait_until

CONTRACT = """
tools:
  - name: send_mail_canonical
    version: "1.0.0"
    description: send_email whose mailbox ids have one canonical form.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [to, subject, body]
      properties:
        to: {type: string, minLength: 3, maxLength: 254}
        subject: {type: string, minLength: 1, maxLength: 200}
        body: {type: string, minLength: 1, maxLength: 5000}
    resources:
      - template: "mailbox:{to}"
        access: exclusive
        canonical: {unicode: NFC, case: fold, pattern: "[^@\\\\s]+@[^@\\\\s]+"}
    idempotency: {required: true}
    timeout_ms: 5000
    backend: {type: http, service: demo, path: /tools/send_email}
    status_endpoint: {service: demo, path: /status/send_email}
"""

COMPOSED = unicodedata.normalize("NFC", "josé.núñez@example.com")
VARIANT = unicodedata.normalize("NFD", "José.Núñez@Example.COM")  # decomposed accents, other case
MAIL = {"subject": "Your refund", "body": "It is on its way."}


def sends(stack) -> list[dict]:
    return [r for r in stack.backend.requests if r["tool"] in ("send_email", "send_mail_canonical")]


async def test_two_spellings_of_one_mailbox_are_one_operation_one_lock_and_one_freeze(proxy_deps, tmp_path):
    assert VARIANT != COMPOSED and unicodedata.normalize("NFC", VARIANT).casefold() == COMPOSED
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, CONTRACT),
                              "reconcile.enabled": False}) as stack:
        run = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
        status, first = await stack.call("send_mail_canonical", {"to": COMPOSED, **MAIL}, headers=run)
        assert status == 200 and first["outcome"] == "succeeded", first
        status, again = await stack.call("send_mail_canonical", {"to": VARIANT, **MAIL}, headers=run)
        assert again["outcome"] == "succeeded" and again.get("replayed") is True, again  # the same operation
        assert again["idempotency_key"] == first["idempotency_key"]
        assert first["evidence"]["resource_keys"] == ["mailbox:jos%C3%A9.n%C3%BA%C3%B1ez@example.com"]
        assert len(sends(stack)) == 1 and stack.backend.effect_counts().get("send_email") == 1

        # One freeze: an unknown outcome on the composed spelling keeps the variant off the mailbox.
        await stack.fault("send_email", "drop_after_commit", count=1)
        other = {**MAIL, "body": "A second message."}
        _, unknown = await stack.call("send_mail_canonical", {"to": COMPOSED, **other},
                                      headers={"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"})
        assert unknown["error"]["code"] == "timeout_unknown", unknown
        _, frozen = await stack.call("send_mail_canonical", {"to": VARIANT, **other},
                                     headers={"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"})
        assert frozen["error"]["code"] == "operation_unknown", frozen
        assert frozen["error"]["details"]["blocking_operation"] == unknown["idempotency_key"]
        assert len(sends(stack)) == 2  # the variant was never sent
        # The backend got the canonical spelling: one mailbox, one object.
        assert {m["to"] for m in stack.backend.outbox} == {COMPOSED}


async def test_a_value_with_no_canonical_form_is_refused_before_anything_runs(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, CONTRACT)}) as stack:
        status, env = await stack.call("send_mail_canonical", {"to": "no at sign", **MAIL})
        assert env["error"]["code"] == "invalid_arguments" and env["error"]["details"]["path"] == "to", env
        assert sends(stack) == []


def test_one_argument_has_one_canonical_form(tmp_path):
    clash = CONTRACT.replace('''        canonical: {unicode: NFC, case: fold, pattern: "[^@\\\\s]+@[^@\\\\s]+"}''',
                             '''        canonical: {unicode: NFC, case: fold}
      - template: "outbox:{to}"
        canonical: {unicode: NFKC}''')
    path = tmp_path / "clash.yaml"
    path.write_text(clash)
    with pytest.raises(RegistryError, match="another canonical form"):
        load_registry([DEMO_REGISTRY, path])
    path.write_text(CONTRACT.replace("[^@\\\\s]+@[^@\\\\s]+", "(unclosed"))
    with pytest.raises(RegistryError, match="not a regular expression"):
        load_registry([DEMO_REGISTRY, path])


REPORTS = """
tools:
  - name: {name}
    version: "1.0.0"
    description: generate_report whose report titles have one canonical form.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [title, duration_ms]
      properties:
        title: {{type: string, minLength: 1, maxLength: 200}}
        duration_ms: {{type: integer, minimum: 1, maximum: 600000}}
    outputSchema:
      type: object
      additionalProperties: false
      required: [report_id, title, status]
      properties:
        report_id: {{type: string}}
        title: {{type: string}}
        status: {{enum: [ready]}}
    resources:
      - template: "report:{{title}}"
        access: exclusive
        canonical: {canonical}
    idempotency: {{required: true}}
    timeout_ms: 10000
    backend: {{type: http, service: demo, path: /tools/generate_report}}
    status_endpoint: {{service: demo, path: /status/generate_report}}
"""
TIMED = REPORTS.format(name="daily_report", canonical="{time: instant}")
ALIASED = REPORTS.format(name="board_report",
                         canonical='{case: fold, aliases_file: board-aliases.json, aliases: {"the board pack": '
                                   'board-2026-q4}}')


@pytest.mark.parametrize("tool, first, second, canonical", [
    ("daily_report", "2026-12-02T10:00:00+01:00", "20261202T090000Z", "2026-12-02T09:00:00Z"),
    ("board_report", "Q4 Board Pack", "board-2026-q4", "board-2026-q4"),
])
async def test_a_time_notation_or_an_alias_is_one_lock_and_one_operation_key(proxy_deps, tmp_path, tool, first,
                                                                            second, canonical):
    (tmp_path / "board-aliases.json").write_text('{"q4 board pack": "board-2026-q4"}')
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, TIMED + ALIASED.replace("tools:\n", ""))}) \
            as stack:
        run = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
        holder = asyncio.ensure_future(stack.call(tool, {"title": first, "duration_ms": 1500}, headers=run))
        await wait_until(lambda: any(r["tool"] == "generate_report" for r in stack.backend.requests),
                         what="the first report under way")
        # Another report of the same object, in the other spelling, while the first holds the lock.
        status, busy = await stack.call(tool, {"title": second, "duration_ms": 1},
                                        headers={"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}",
                                                 "Request-Timeout": "0.3"})
        assert busy["error"]["code"] == "resource_busy", busy
        status, held = await asyncio.wait_for(holder, 10)
        assert held["outcome"] == "succeeded" and held["data"]["title"] == canonical, held
        # The same intent in the other spelling is the same operation: replayed, never run again.
        status, again = await stack.call(tool, {"title": second, "duration_ms": 1500}, headers=run)
        assert again.get("replayed") is True and again["idempotency_key"] == held["idempotency_key"], again
        assert len([r for r in stack.backend.requests if r["tool"] == "generate_report"]) == 1
        assert list(stack.backend.reports.values()) == [canonical]  # the backend saw one spelling


async def test_an_edit_of_an_alias_file_reloads_the_registry_and_the_new_alias_names_the_object(proxy_deps,
                                                                                                tmp_path):
    aliases = tmp_path / "board-aliases.json"
    aliases.write_text('{"q4 board pack": "board-2026-q4"}')
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, ALIASED), "registry.reload_interval_ms": 0,
                              "reconcile.enabled": False}) as stack:
        assert await stack.runtime.reloader.reload(force=False) == "unchanged"
        aliases.write_text('{"q4 board pack": "board-2026-q4", "the december pack": "board-2026-q4"}')
        assert await stack.runtime.reloader.reload(force=False) == "applied"  # only the alias file changed
        status, env = await stack.call("board_report", {"title": "The December Pack", "duration_ms": 1})
        assert env["outcome"] == "succeeded" and env["data"]["title"] == "board-2026-q4", env


def test_a_registry_reload_watches_the_alias_files_its_contracts_name(tmp_path):
    (tmp_path / "board-aliases.json").write_text('{"q4 board pack": "board-2026-q4"}')
    registry_file = tmp_path / "reports.yaml"
    registry_file.write_text(ALIASED)
    registry = load_registry([DEMO_REGISTRY, registry_file])
    assert registry.named_files == (str((tmp_path / "board-aliases.json").resolve()),)
    before = files_digest([str(DEMO_REGISTRY), str(registry_file)], registry.named_files)
    (tmp_path / "board-aliases.json").write_text('{"q4 board pack": "board-2026-q4", "board": "board-2026-q4"}')
    assert files_digest([str(DEMO_REGISTRY), str(registry_file)], registry.named_files) != before
    (tmp_path / "board-aliases.json").write_text('{"q4 board pack": "board-2026-q4", "x": "q4 board pack"}')
    with pytest.raises(RegistryError, match=r"canonical\.aliases.*both an alias and the target"):
        load_registry([DEMO_REGISTRY, registry_file])
