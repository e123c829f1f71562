"""How long does `toolproxy policy replay` take for 10,000 decision records?

Builds N decision records the way the proxy does (``policy.build_input`` +
``decisions.build_record``, decisions from the repo's policy in a scratch
opa): 50% own-order reads, 10% multi-order reads, 15% foreign-tenant reads
(denied), 25% refunds of 100..9,900 cents with the masked ``reason``. Then
times the replay against (a) the same policy and (b) a candidate whose
refund approval threshold is 1,000 instead of 5,000, and compares three ways
of evaluating the same 1,000 inputs: our batch module (one query per 250
inputs, 4 in flight), opa-python-client's ``bulk_query_rule`` (one ad-hoc
query with every input inlined), and one Data API query per input.

    .venv/bin/python -m bench.policy_replay [N]

Target: N = 10,000 replays in well under a minute on the 2-core dev machine;
this is a benchmark, not a test, so read the numbers.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from proxy.policy.decisions import build_record
from proxy.identity import Caller
from proxy.normalize import normalize
from proxy.policy.client import Decision, RequestFacts, build_input, catalog_document
from proxy.authoring.policy_reads import policy_reads
from proxy.authoring.policy_replay import replay
from proxy.authoring.policy_scratch import ScratchOpa
from proxy.registry import load_registry
from proxy.telemetry.record_view import ephemeral_key

REPO = Path(__file__).resolve().parent.parent
POLICY = str(REPO / "policies")
DATA = str(REPO / "examples" / "opa")


def inputs(n: int, catalog_digest: str) -> tuple[list[dict], list[tuple[str, ...]]]:
    registry = load_registry([str(REPO / "examples" / "registry")])
    caller = Caller(subject="dev-user", tenant="acme", roles=("agent",), scopes=("tools:read", "tools:write"),
                    agent="dev-agent", source="jwt")
    rng = random.Random(18)
    documents, views = [], []
    for i in range(n):
        roll = rng.random()
        if roll < 0.5:
            tool, args = "get_order", {"order_id": rng.choice(["ord_1001", "ord_1002", "ord_1003"])}
        elif roll < 0.6:
            tool, args = "get_orders", {"order_ids": ["ord_1001", "ord_1003"]}
        elif roll < 0.75:
            tool, args = "get_order", {"order_id": "ord_2001"}
        else:
            tool, args = "refund_order", {"order_id": "ord_1001", "amount": rng.randrange(100, 10000, 100),
                                          "reason": "customer asked"}
        contract = registry.resolve(tool)
        documents.append(build_input("call", caller, RequestFacts(request_id=f"req-{i}"),
                                     catalog_digest=catalog_digest, tool=contract,
                                     normalized=normalize(contract, args)))
        views.append(contract.record_view)
    return documents, views


async def main(n: int) -> None:
    catalog = catalog_document(load_registry([str(REPO / "examples" / "registry")]))
    documents, views = inputs(n, catalog["digest"])
    async with ScratchOpa(POLICY, [DATA], catalog=catalog) as opa:
        decided = await opa.evaluate(documents)
    records, key = [], ephemeral_key()
    for document, view, result in zip(documents, views, decided):
        decision = Decision(allow=result["allow"], require_approval=result["require_approval"],
                            reasons=tuple(result["reasons"]), risk=result.get("risk", "unknown"),
                            policy_revision=result["policy_revision"])
        records.append(build_record(document, decision, decision_path="toolproxy/decision",
                                    view=view, key=key, max_bytes=65536))
    masked = sum(1 for r in records if r["masked_paths"])
    print(f"{n} records ({masked} with a masked path)")

    candidate = Path(tempfile.mkdtemp(prefix="toolproxy-bench-candidate-"))
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["approval"]["thresholds"]["refund_order"]["default"] = 1000
    (candidate / "data.json").write_text(json.dumps(data))

    for label, data_dir in (("same policy", DATA), ("threshold 5000 -> 1000", str(candidate))):
        started = time.perf_counter()
        async with ScratchOpa(POLICY, [data_dir], catalog=catalog) as opa:
            ready = time.perf_counter()
            report = await replay(records, opa, policy_reads(POLICY, opa.binary))
        done = time.perf_counter()
        print(f"{label:<24} total {done - started:6.2f} s (opa start {ready - started:4.2f} s, "
              f"replay {done - ready:6.2f} s, {report.queries} OPA round trips): changed {report.changed}, "
              f"transitions {json.dumps({t: dict(c) for t, c in report.transitions.items()})}")

    sample = documents[:1000]
    async with ScratchOpa(POLICY, [DATA], catalog=catalog) as opa:
        for label, run in (
            ("batch module (250/query, 4 in flight)", lambda: opa.evaluate(sample)),
            ("opa-python-client bulk_query_rule", lambda: _bulk(opa, sample)),
            ("one Data API query per input", lambda: _one_by_one(opa, sample)),
        ):
            started = time.perf_counter()
            results = await run()
            elapsed = time.perf_counter() - started
            assert [r["allow"] for r in results] == [r["allow"] for r in decided[:1000]]
            print(f"1000 inputs, {label:<40} {elapsed:6.2f} s")


async def _bulk(opa: ScratchOpa, sample: list[dict]) -> list:
    out = []
    for i in range(0, len(sample), 250):  # the client inlines every input into one query string
        out.extend(await opa.client.bulk_query_rule(sample[i:i + 250], "toolproxy", "decision"))
    return out


async def _one_by_one(opa: ScratchOpa, sample: list[dict]) -> list:
    return [await opa.decide(document) for document in sample]


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10000))
