"""Operation-key derivation without Redis (proxy/idempotency.py: derive_key, per_request_key)."""

from __future__ import annotations

import re

from proxy.idempotency import KEY_PATTERN, derive_key, per_request_key

BASE = dict(tenant="t1", subject="alice", tool="refund_order", tool_version="1.0.0", args_hash="a" * 64)


def key(**changes):
    return derive_key(**{**BASE, "idempotency_key": None, "run_id": None, **changes})


def test_no_stable_identity_means_no_key():
    assert key() is None


def test_a_header_key_is_scoped_by_tenant_and_tool_but_not_by_arguments():
    first = key(idempotency_key="k1")
    assert re.match(KEY_PATTERN, first.key) and first.source == "idempotency_key"
    assert key(idempotency_key="k1").key == first.key  # stable
    assert key(idempotency_key="k1", args_hash="b" * 64).key == first.key  # same key, other arguments...
    assert key(idempotency_key="k1", args_hash="b" * 64).fingerprint != first.fingerprint  # ...is a conflict
    assert key(idempotency_key="k1", tenant="t2").key != first.key
    assert key(idempotency_key="k1", tool="get_order").key != first.key
    assert key(idempotency_key="k2").key != first.key


def test_a_run_id_key_covers_the_call_itself():
    first = key(run_id="run_1")
    assert first.source == "run_id"
    assert key(run_id="run_1", args_hash="b" * 64).key != first.key
    assert key(run_id="run_1", subject="bob").key != first.key
    assert key(run_id="run_2").key != first.key


def test_a_header_key_wins_over_a_run_id_and_plan_calls_get_their_own_keys():
    assert key(idempotency_key="k1", run_id="run_1").source == "idempotency_key"
    assert key(idempotency_key="k1", plan_call_id="a").key != key(idempotency_key="k1", plan_call_id="b").key
    assert key(idempotency_key="k1", plan_call_id="a").key != key(idempotency_key="k1").key


def test_a_per_request_key_is_never_matched_by_a_retry():
    one, two = per_request_key(**BASE), per_request_key(**BASE)
    assert one.key != two.key and one.fingerprint == two.fingerprint and one.source == "request"
    assert re.match(KEY_PATTERN, one.key)


def test_header_key_is_scoped_to_tenant_subject_and_tool_and_fingerprints_the_arguments():
    base = dict(subject="u1", tool="refund_order", tool_version="1.0.0", args_hash="a" * 64,
                idempotency_key="k1", run_id=None)
    acme, globex = derive_key(tenant="acme", **base), derive_key(tenant="globex", **base)
    assert acme.key != globex.key
    assert derive_key(tenant="acme", **{**base, "tool": "send_email"}).key != acme.key
    other_args = derive_key(tenant="acme", **{**base, "args_hash": "b" * 64})
    assert other_args.key == acme.key and other_args.fingerprint != acme.fingerprint
    other_subject = derive_key(tenant="acme", **{**base, "subject": "u2"})
    assert other_subject.key != acme.key  # another subject's same header is another operation
    assert acme.key.startswith("ik_") and len(acme.key) == 67


def test_run_id_key_names_the_whole_operation_and_no_identity_means_no_key():
    base = dict(tenant="acme", subject="u1", tool="refund_order", tool_version="1.0.0", idempotency_key=None,
                run_id="run_7.turn_2")
    one, two = derive_key(args_hash="a" * 64, **base), derive_key(args_hash="b" * 64, **base)
    assert one.key != two.key and one.source == "run_id"
    assert derive_key(args_hash="a" * 64, **{**base, "run_id": "run_7.turn_3"}).key != one.key
    assert derive_key(args_hash="a" * 64, **{**base, "run_id": None}) is None
    # No field can bleed into its neighbour ("ac" + "meu1" is not "acme" + "u1").
    assert derive_key(**{**base, "tenant": "ac", "subject": "meu1"}, args_hash="a" * 64).key != \
        derive_key(**{**base, "tenant": "acme", "subject": "u1"}, args_hash="a" * 64).key
