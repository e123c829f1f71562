"""Call tokens: the signed Txn-Token every request the proxy sends for a call carries, and its check.

The shape follows the IETF OAuth Transaction Tokens draft (draft-ietf-oauth-transaction-tokens):
a JWT with header ``typ: txntoken+jwt`` (EdDSA or ES256, ``kid``), sent in the ``Txn-Token`` header,
with ``iss``, ``aud`` (the backend service), ``iat``, ``exp`` (at most the call's deadline and
five minutes), ``txn`` (the operation), ``sub``, ``tenant``, ``req_wl`` (the agent), ``scope``
(``tool:call``, ``tool:status`` or ``tool:cancel``) and the call's facts in ``tctx``.

- ``keys``: loading, generating and publishing (JWKS) the signing key and the keys that verify.
- ``signer``: the proxy's side (one key object and header, cached; one signature per request).
- ``verifier``: the backend's side, a function (``CallTokenVerifier.verify``).
- ``middleware``: the same check as aiohttp and ASGI middleware.

This wing imports nothing else from ``proxy``: a backend owner can import the verifier without the
proxy's dependencies beyond PyJWT[crypto] and rfc8785 (tests/unit/test_import_cycles.py holds it so).
"""

HEADER = "Txn-Token"
TOKEN_TYPE = "txntoken+jwt"
ALGORITHMS = ("EdDSA", "ES256")
MAX_TTL_S = 300
SCOPES = ("tool:call", "tool:status", "tool:cancel")
