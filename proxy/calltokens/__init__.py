"""Call tokens: the signed Txn-Token every request the proxy sends for a call carries, and its check.

The shape follows the IETF OAuth Transaction Tokens draft (draft-ietf-oauth-transaction-tokens):
a JWT with header ``typ: txntoken+jwt`` (EdDSA or ES256, ``kid``), sent in the ``Txn-Token`` header,
with ``iss``, ``aud`` (the backend service), ``iat``, ``exp`` (at most the call's deadline and
five minutes), ``txn`` (the operation), ``sub``, ``tenant``, ``req_wl`` (the agent), ``scope``
(``tool:call``, ``tool:status`` or ``tool:cancel``) and the call's facts in ``tctx``.

- ``keys``: loading, generating and publishing (JWKS) the signing key and the keys that verify.
- ``signer``: the proxy's side (one key object and header, cached; one signature per request).

The backend's side (the verifier and its aiohttp and ASGI middlewares) is the separate distribution
``toolproxy-verifier`` (module ``toolproxy_verifier/``, built by ``packages/toolproxy-verifier/``), which
backend teams install alone; the token's shape (header, type, algorithms, scopes) is defined there once and
imported here. This wing imports nothing else from ``proxy`` (tests/unit/test_import_cycles.py holds it so).
"""

from toolproxy_verifier import ALGORITHMS, HEADER, SCOPES, TOKEN_TYPE

__all__ = ["ALGORITHMS", "HEADER", "MAX_TTL_S", "SCOPES", "TOKEN_TYPE"]

MAX_TTL_S = 300
