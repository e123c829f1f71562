"""Record MACs (proxy/integrity.py): what each binds, key files, constant-time checks."""

from __future__ import annotations

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
    assert not mac.same(good, None) and not mac.same(good, "") and not mac.same(good, good[:-1] + "0")


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
