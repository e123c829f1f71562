"""OpenAI function-calling front: ``POST /v1/openai/tool-calls``.

Owns: translating the tool calls of one model turn — the ``tool_calls`` of a
Chat Completions assistant message, or the ``function_call`` items of a
Responses API output — into one batch of pipeline calls, and the batch's
envelopes back into ready-to-append items in request order: Chat ``tool``
messages (``tool_call_id``) or Responses ``function_call_output`` items
(``call_id``), each carrying the JSON result envelope.

Must never: reorder outputs (they follow the request, not completion),
let the model's call id into an operation key (a re-planned turn gets new
ids for the same intent: the business request id is the runner's ``X-Run-Id``),
parse arguments itself (the decode stage does, strictly), or run a call
outside the batch scheduler (which runs each through ``Pipeline.execute``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from . import ingress
from ..config import Config
from ..envelope import Envelope
from ..errors import ProxyError
from ..identity import Authenticator, Caller
from ..batch.plan import BatchPlan, PlannedCall
from ..requests import RequestMeta
from ..batch.scheduler import Scheduler

CHAT, RESPONSES = "chat", "responses"


@dataclass(frozen=True)
class FunctionCall:
    call_id: str
    name: str
    arguments: str  # JSON text as the model emitted it; decoded by the pipeline


@dataclass(frozen=True)
class ModelTurn:
    shape: str  # chat | responses
    calls: tuple[FunctionCall, ...]
    order: str = "dag"  # "list": the caller states the turn's order is meant for writes on one resource


def parse(body: Any) -> ModelTurn:
    """The function calls of one model turn; ``invalid_request`` if the body is neither shape."""
    ingress.validate_body(body, "openai-tool-calls-request.schema.json")
    if "tool_calls" in body:
        turn = ModelTurn(CHAT, tuple(FunctionCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                                     for c in body["tool_calls"]))
    else:
        turn = ModelTurn(RESPONSES, tuple(FunctionCall(i["call_id"], i["name"], i["arguments"])
                                          for i in body["output"] if i["type"] == "function_call"))
        if not turn.calls:
            raise ProxyError("invalid_request", "The output holds no function_call items.", phase="request")
    if body.get("order") == "list":
        turn = ModelTurn(turn.shape, turn.calls, "list")
    seen: set[str] = set()
    for call in turn.calls:
        if call.call_id in seen:
            raise ProxyError("invalid_request", "Two tool calls share one id; outputs could not be matched.",
                             details={"call_id": call.call_id}, phase="request")
        seen.add(call.call_id)
    return turn


@dataclass(frozen=True)
class TurnResult:
    envelopes: tuple[Envelope, ...]        # request order
    batch: dict[str, Any]                  # summary: status, uncertain call ids, effects, next action


def model_view(env: Envelope) -> dict[str, Any]:
    """What the model reads of a call's result (each token of it is paid for every turn): the outcome, the
    data, the error's code, message, whether to retry and what to do, whether a call that did not succeed
    applied anything (``committed``: true, false, or null when unknown). Timing,
    digests, ids and details are for programs: the response's ``envelopes``."""
    view: dict[str, Any] = {"outcome": env.outcome}
    if env.data is not None:
        view["data"] = env.data
    if env.error is not None:
        error = env.error.to_error()
        view["error"] = {k: error[k] for k in ("code", "message", "retryable", "resolution") if k in error}
    side_effect = env.side_effect.to_json()
    if env.outcome != "succeeded" and side_effect.get("attempted"):  # did a failed or unknown call apply anything
        view["committed"] = side_effect.get("committed")
    if env.partial is not None:
        view["partial"] = env.partial
    if env.truncated:
        view["truncated"] = True
    if env.replayed:
        view["replayed"] = True
    return view


def render(turn: ModelTurn, result: TurnResult) -> dict[str, Any]:
    """The response body: one item per call, in request order, each output the model's view of its result as
    JSON text (``model_view``), and ``envelopes``: the whole envelope of each call, in the same order."""
    def text(env: Envelope) -> str:  # the edge: the model's view as JSON, once
        return json.dumps(model_view(env), ensure_ascii=False, separators=(",", ":"))

    pairs = list(zip(turn.calls, result.envelopes))
    envelopes = [env.to_json() for env in result.envelopes]
    if turn.shape == CHAT:
        return {"messages": [{"role": "tool", "tool_call_id": call.call_id, "content": text(env)}
                             for call, env in pairs], "envelopes": envelopes, "batch": result.batch}
    return {"items": [{"type": "function_call_output", "call_id": call.call_id, "output": text(env)}
                      for call, env in pairs], "envelopes": envelopes, "batch": result.batch}


def _summary(envelopes: Sequence[Envelope], request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "uncertain": [env.call_id for env in envelopes if env.outcome == "unknown"]}


async def run_turn(scheduler: Scheduler, turn: ModelTurn, meta: RequestMeta, caller: Caller) -> TurnResult:
    """Run the turn's calls as one batch on the scheduler (the process's one ``Scheduler``, the engine of
    ``POST /v1/tool-calls:batch``): reads in parallel, conflicting calls serialized in request
    order, limits applied, results merged in request order. Operation keys come from the headers only:
    ``X-Run-Id`` (the run, task or conversation the turn serves: the same refund asked for again by a later
    or re-planned turn is the same operation) or ``Idempotency-Key``; a write without either is refused
    (``idempotency_key_required``, saying how to send one), never keyed on its ``tool_call.id``. Two
    writes on one resource in one turn state no order: refused (``invalid_plan``) unless the body says
    ``"order": "list"``.
    """
    plan = BatchPlan(calls=tuple(PlannedCall(call_id=c.call_id, tool=c.name, arguments=c.arguments)
                                 for c in turn.calls), meta=meta, order=turn.order)
    batch = await scheduler.run(plan, caller)
    summary = {**_summary(batch.results, meta.request_id), "status": batch.status,
               "committed_effects": list(batch.committed_effects),
               "uncertain_effects": list(batch.uncertain_effects), "next_action": batch.next_action}
    return TurnResult(tuple(batch.results), summary)


def install(app: web.Application, *, config: Config, authenticator: Authenticator, scheduler: Scheduler) -> None:
    async def post_tool_calls(request: web.Request) -> web.Response:
        meta = ingress.request_meta(request, config)
        caller = await authenticator.authenticate(request.headers, request.remote)
        turn = parse(await ingress.read_json(request, config))
        body = render(turn, await run_turn(scheduler, turn, meta, caller))
        return web.Response(text=json.dumps(body, ensure_ascii=False, separators=(",", ":")),
                            content_type="application/json")

    app.router.add_post("/v1/openai/tool-calls", post_tool_calls)
