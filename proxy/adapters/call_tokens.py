"""Call tokens on the proxy's side: the Txn-Token each request sent for a call carries.

Owns: the process's one signer (its key from ``call_tokens.signing_key_file``, or generated at start-up
when none is configured), the ``aud`` of a backend endpoint (``call_tokens.audiences``, else the service
name, else a URL's origin), the claims of a call's request (``for_call``: the contract, ``args_hash``,
operation key, fencing token, decision and approval ids in ``tctx``; ``txn`` is the operation key, or a
fresh id for a call without one) and of a status or cancel request for an operation (``for_operation``),
and the JWKS the ops listener serves (``/.well-known/jwks.json``). Must never: put argument values (only
their hash) or anything from the model into a token, or sign for longer than the call's deadline.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping
from urllib.parse import urlsplit

from ..calltokens import keys as token_keys
from ..calltokens.signer import CallTokenSigner
from ..config import CallTokensConfig, ConfigError
from ..registry import Endpoint, ToolContract
from . import BackendCall

log = logging.getLogger("toolproxy.call_tokens")


class CallTokens:
    def __init__(self, signer: CallTokenSigner, *, audiences: Mapping[str, str] | None = None,
                 extra_keys: tuple[Mapping[str, Any], ...] = ()) -> None:
        self._signer = signer
        self._audiences = dict(audiences or {})
        self._by_endpoint: dict[Endpoint, str] = {}
        self.jwks = token_keys.jwks(signer.key, extra_keys)
        self.kid = signer.key.kid
        self.ephemeral = False  # signed with a key generated at start-up (no signing_key_file)

    def audience(self, endpoint: Endpoint) -> str:
        audience = self._by_endpoint.get(endpoint)
        if audience is None:
            if endpoint.service:
                audience = self._audiences.get(endpoint.service, endpoint.service)
            else:
                parts = urlsplit(endpoint.url or "")
                audience = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
            if len(self._by_endpoint) < 4096:  # endpoints come from contracts: a bounded set
                self._by_endpoint[endpoint] = audience
        return audience

    def for_call(self, call: BackendCall) -> str:
        tool = call.tool
        context: dict[str, Any] = {"tool": tool.name, "version": tool.version, "args_hash": call.args_hash,
                                   "call_id": call.call_id}
        if tool.backend.type == "mcp" and tool.backend.tool:
            context["mcp_tool"] = tool.backend.tool
        if call.idempotency_key is not None:
            context["idempotency_key"] = call.idempotency_key
        if call.fencing_token is not None:
            context["fencing_token"] = call.fencing_token
        if call.decision_id is not None:
            context["decision_id"] = call.decision_id
        if call.approval_id is not None:
            context["approval_id"] = call.approval_id
        return self._signer.sign(audience=self.audience(tool.backend), scope="tool:call",
                                 txn=call.idempotency_key or uuid.uuid4().hex, subject=call.subject,
                                 tenant=call.tenant, agent=call.agent, context=context,
                                 budget_s=call.deadline.budget())

    def for_operation(self, tool: ToolContract, endpoint: Endpoint, *, scope: str, key: str, tenant: str,
                      subject: str, agent: str, version: str, budget_s: float) -> str:
        """A status (``tool:status``) or cancel (``tool:cancel``) request about operation ``key``."""
        context = {"tool": tool.name, "version": version, "idempotency_key": key}
        return self._signer.sign(audience=self.audience(endpoint), scope=scope, txn=key, subject=subject,
                                 tenant=tenant, agent=agent, context=context, budget_s=budget_s)


def load_call_tokens(config: CallTokensConfig) -> CallTokens:
    """The process's signer; a key that cannot be used stops start-up with one line (ConfigError)."""
    try:
        if config.signing_key_file:
            key = token_keys.load_signing_key(config.signing_key_file, config.key_id)
        else:  # the runtime says so once it is open (``warn_if_ephemeral``)
            key = token_keys.signing_key(token_keys.generate("EdDSA"), config.key_id)
        extra = token_keys.load_jwks(config.verification_keys_file) if config.verification_keys_file else []
    except token_keys.KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    tokens = CallTokens(CallTokenSigner(key, issuer=config.issuer, ttl_s=config.ttl_s),
                        audiences=config.audiences, extra_keys=tuple(extra))
    tokens.ephemeral = not config.signing_key_file
    return tokens


def warn_if_ephemeral(tokens: CallTokens) -> None:
    if tokens.ephemeral:
        log.warning("call_tokens.signing_key_file is not set: call tokens are signed with a key generated at "
                    "start-up (kid %s); backends can verify them only through this process's JWKS", tokens.kid)
