"""Record MACs (proxy/integrity.py): what each binds, key files, constant-time checks."""

from __future__ import annotations

import base64

import pytest

from proxy.integrity import IntegrityKeyError, RecordMac

KEY = b"k" * 32
APPROVAL = {"approval_id": "apr_1", "tenant": "acme", "subject": "alice", "tool": "refund_order",
            "tool_version": "1.0.0", "args_hash": "a" * 64, "expires_at_ms": 1000, "risk": "financial",
            "status": "approved", "approver": "bob", "requester": "alice@acme.test"}


def test_every_field_of_an_approvals_binding_changes_its_mac():
    mac = RecordMac(KEY)
    base = mac.approval(**APPROVAL)
    assert base.startswith("m1:") and mac.approval(**APPROVAL) == base
    for name, value in APPROVAL.items():
        other = {**APPROVAL, name: str(value) + "x"}
        assert mac.approval(**other) != base, name
    assert RecordMac(b"j" * 32).approval(**APPROVAL) != base  # another key


def test_fields_cannot_bleed_into_each_other():
    mac = RecordMac(KEY)
    assert mac.approval(**{**APPROVAL, "tenant": "ac", "subject": "mealice"}) != mac.approval(**APPROVAL)


def test_an_outcome_mac_binds_key_fingerprint_state_and_text():
    mac = RecordMac(KEY)
    base = mac.outcome(key="ik_1", fingerprint="fp", state="SUCCEEDED", outcome='{"data":1}')
    assert base != mac.outcome(key="ik_2", fingerprint="fp", state="SUCCEEDED", outcome='{"data":1}')
    assert base != mac.outcome(key="ik_1", fingerprint="fq", state="SUCCEEDED", outcome='{"data":1}')
    assert base != mac.outcome(key="ik_1", fingerprint="fp", state="FAILED_FINAL", outcome='{"data":1}')
    assert base != mac.outcome(key="ik_1", fingerprint="fp", state="SUCCEEDED", outcome='{"data":2}')
    assert mac.approval_used(**{k: v for k, v in APPROVAL.items() if k not in ("status", "approver", "risk", "requester")},
                             used_at_ms=5, used_for="ik_1") != base


def test_same_is_false_for_a_missing_or_different_mac():
    mac = RecordMac(KEY)
    good = mac.outcome(key="ik_1", fingerprint="fp", state="SUCCEEDED", outcome="")
    assert mac.same(good, good)
    other = good[:-1] + ("A" if good[-1] != "A" else "B")
    assert not mac.same(good, None) and not mac.same(good, "") and not mac.same(good, other)


def test_an_outcome_mac_is_written_compact_and_either_form_verifies():
    """Records carry the ``m2`` form (the HMAC in base64url: 46 characters, not 67); a record written with
    ``m1`` by a version before it still verifies, and a MAC of neither form, or of another binding, never does."""
    mac = RecordMac(KEY)
    binding = {"key": "ik_1", "fingerprint": "fp", "state": "SUCCEEDED", "outcome": '{"data":1}'}
    compact, hex_form = mac.outcome(**binding), mac.outcome(**binding, version="m1")
    assert compact.startswith("m2:") and len(compact) == 46 and hex_form.startswith("m1:") and len(hex_form) == 67
    assert base64.urlsafe_b64decode(compact[3:] + "=") == bytes.fromhex(hex_form[3:])  # one HMAC, two spellings
    assert mac.outcome_matches(compact, **binding) and mac.outcome_matches(hex_form, **binding)
    assert not mac.outcome_matches(compact, **{**binding, "state": "FAILED_FINAL"})
    assert not mac.outcome_matches(hex_form, **{**binding, "outcome": '{"data":2}'})
    assert not mac.outcome_matches("m3:" + compact[3:], **binding) and not mac.outcome_matches(None, **binding)
    assert not mac.outcome_matches(compact[3:], **binding)


def test_key_files(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(IntegrityKeyError, match="at least 32 are needed"):
        RecordMac.from_file(str(short))
    with pytest.raises(IntegrityKeyError, match="cannot read"):
        RecordMac.from_file(str(tmp_path / "missing"))
    good = tmp_path / "key"
    good.write_text("f" * 64 + "\n")
    assert not RecordMac.from_file(str(good)).ephemeral
    assert RecordMac.from_file(str(good)).approval(**APPROVAL) == RecordMac(b"f" * 64).approval(**APPROVAL)
    ephemeral = RecordMac.from_file("")
    assert ephemeral.ephemeral and ephemeral.approval(**APPROVAL) != RecordMac.from_file("").approval(**APPROVAL)
