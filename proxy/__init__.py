"""toolproxy: a policy-driven sidecar proxy for AI-agent tool calls.

The package reads as the pipeline of one call (see ``pipeline``): resolve
(``registry``), decode (``decode``), normalize (``normalize``), identify
(``identity``), authorize, idempotency, lock, execute (``adapters``), verify
(``verify``), commit (``envelope``). ``app`` only translates HTTP into one
request object and one envelope back.
"""

__version__ = "0.1.0"
