"""toolproxy-verifier: a tool backend's check of toolproxy's call tokens, without the proxy.

Every request toolproxy sends for a call (the call itself, a status query, a cancel request, a compensating
call) carries a ``Txn-Token`` header: a JWT in the shape of the IETF OAuth Transaction Tokens draft
(``typ: txntoken+jwt``, EdDSA or ES256, ``kid``) that binds the tool, the RFC 8785 hash of the arguments, the
operation key and the fencing token for a few seconds. A backend checks it and refuses anything else.

- ``verifier``: the check as a function (``CallTokenVerifier.verify``), the key sources (``JwksFile``,
  ``StaticKeys``) and the replay memory (``ReplayCache``).
- ``middleware``: the same check as aiohttp middleware (``aiohttp_middleware``) and ASGI middleware
  (``AsgiCallTokens``).

Owns: the token's shape as both sides read it (the header name, the token type, the algorithms, the
scopes below); the proxy's signer (``proxy.calltokens``) takes them from here. Must never: import the proxy
or need more than PyJWT[crypto] and rfc8785 (aiohttp only for its own middleware).
"""

HEADER = "Txn-Token"
TOKEN_TYPE = "txntoken+jwt"
ALGORITHMS = ("EdDSA", "ES256")
SCOPES = ("tool:call", "tool:status", "tool:cancel")
