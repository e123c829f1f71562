"""The CPU a call token costs: signing (the proxy, once per backend request) and verifying (a backend).

Times, in one process on this machine, ``CallTokens.for_call`` of a ``get_order`` read (the claims of a
real ``BackendCall``, one Ed25519 or ES256 signature, the cached header and key object) beside what else
a read costs in the proxy (``bench.floor``'s "proxy CPU ms/call"), and the demo backend's check of it
(``CallTokenVerifier.verify``: signature, claims, RFC 8785 hash of the body, replay memory). Also times
a PyJWT ``jwt.encode`` of the same claims, which builds the header and loads the key on every call.

    .venv/bin/python -m bench.call_tokens [--n 20000]
"""

from __future__ import annotations

import argparse
import time

import jwt

from proxy.adapters import BackendCall
from proxy.adapters.call_tokens import CallTokens
from proxy.calltokens import keys
from proxy.calltokens.signer import CallTokenSigner
from toolproxy_verifier.verifier import CallTokenVerifier
from proxy.normalize import normalize
from proxy.registry import load_registry

from bench.servers import REPO


def per_call_us(fn, n: int) -> float:
    for _ in range(min(n, 500)):
        fn()
    started = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    tool = load_registry([str(REPO / "examples" / "registry")]).resolve("get_order", None)
    normalized = normalize(tool, {"order_id": "ord_1001"})
    call = BackendCall(tool=tool, canonical_arguments=normalized.canonical, arguments=normalized.arguments,
                       call_id="c1", request_id="r1", budget_s=9.9, traceparent="", subject="dev-user",
                       tenant="acme", agent="dev-agent", args_hash=normalized.args_hash, decision_id="d1")
    print(f"{'':28} {'µs/call (CPU)':>14}")
    for alg in ("EdDSA", "ES256"):
        key = keys.signing_key(keys.generate(alg))
        tokens = CallTokens(CallTokenSigner(key, issuer="toolproxy"))
        verifier = CallTokenVerifier(tokens.jwks, audience="demo")
        sign = per_call_us(lambda: tokens.for_call(call), args.n)
        claims = {"iss": "toolproxy", "aud": "demo", "iat": 1, "exp": 2, "txn": "t", "sub": "dev-user",
                  "tenant": "acme", "req_wl": "dev-agent", "scope": "tool:call",
                  "tctx": {"tool": "get_order", "version": tool.version, "args_hash": normalized.args_hash}}
        pem = keys.private_pem(key.private)
        pyjwt = per_call_us(lambda: jwt.encode(claims, pem, algorithm=alg,
                                               headers={"typ": "txntoken+jwt", "kid": key.kid}), args.n // 4)
        issued = [tokens.for_call(call) for _ in range(args.n // 4)]
        it = iter(issued)
        check = per_call_us(lambda: verifier.verify(next(it), tool="get_order", body=normalized.canonical),
                            len(issued) - 500)
        print(f"{alg + ' sign (proxy)':28} {sign:14.1f}")
        print(f"{alg + ' jwt.encode, uncached':28} {pyjwt:14.1f}")
        print(f"{alg + ' verify (backend)':28} {check:14.1f}")


if __name__ == "__main__":
    main()
