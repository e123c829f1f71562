"""POST /v1/openai/tool-calls: bodies built and parsed with the official `openai` types (no network)."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import (
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionToolMessageParam,
)
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import TypeAdapter

from tests.support.stack import assert_envelope, running_stack

TOOL_MESSAGE = TypeAdapter(ChatCompletionToolMessageParam)
CALL_OUTPUT = TypeAdapter(FunctionCallOutput)


def chat_call(call_id: str, name: str, arguments: Any) -> ChatCompletionMessageFunctionToolCall:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ChatCompletionMessageFunctionToolCall(id=call_id, type="function",
                                                 function=Function(name=name, arguments=raw))


def assistant(*calls: ChatCompletionMessageFunctionToolCall) -> dict[str, Any]:
    message = ChatCompletionMessage(role="assistant", content=None, tool_calls=list(calls))
    return message.model_dump(mode="json", exclude_none=True)


MODEL_VIEW = {"outcome", "data", "error", "committed", "partial", "truncated", "replayed"}


def tool_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages (the model's compact view of each result), checked against ``envelopes`` (the whole
    envelope of each call, for programs, in the same order)."""
    messages = [TOOL_MESSAGE.validate_python(m) for m in body["messages"]]
    assert len(body["envelopes"]) == len(messages)
    for message, envelope in zip(messages, body["envelopes"]):
        assert message["role"] == "tool"
        assert_envelope(envelope)
        assert envelope["call_id"] == message["tool_call_id"]
        view = json.loads(message["content"])
        assert set(view) <= MODEL_VIEW and view["outcome"] == envelope["outcome"], view
        assert view.get("data") == envelope["data"]
        if envelope["error"] is not None:
            assert view["error"] == {k: envelope["error"][k] for k in ("code", "message", "retryable", "resolution")}
    return messages


def envelopes(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The whole envelope of each call of a turn (``tool_messages`` checks them against the messages)."""
    tool_messages(body)
    return body["envelopes"]


async def test_two_chat_tool_calls_come_back_as_two_tool_messages_in_request_order(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        # The first call finishes last: the answer still follows the request order.
        await stack.fault("get_order", "slow", delay_ms=300)
        body = assistant(chat_call("call_order", "get_order", {"order_id": "ord_1001"}),
                         chat_call("call_stock", "get_inventory", {"sku": "sku_widget"}))
        status, response = await stack.post("/v1/openai/tool-calls", body)
        assert status == 200, response
        messages = tool_messages(response)
        assert [m["tool_call_id"] for m in messages] == ["call_order", "call_stock"]
        order, stock = envelopes(response)
        assert order["outcome"] == "succeeded" and order["data"]["order_id"] == "ord_1001"
        assert stock["outcome"] == "succeeded" and stock["tool"] == "get_inventory"
        assert response["batch"]["status"] == "succeeded"


async def test_each_call_fails_on_its_own_and_writes_keep_request_order(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        body = assistant(chat_call("call_1", "adjust_counter", {"counter": "ctr_oa", "delta": 1}),
                         chat_call("call_2", "adjust_counter", '{"counter": "ctr_oa", "delta": 2'),
                         chat_call("call_3", "adjust_counter", {"counter": "ctr_oa", "delta": 10}),
                         chat_call("call_4", "get_countr", {"counter": "ctr_oa"}))  # misspelled
        run = {"X-Run-Id": "task-oa"}  # the business request the turn serves: the writes' key
        status, response = await stack.post("/v1/openai/tool-calls", body, headers=run)  # two writes, no order
        assert status == 400 and response["error"]["code"] == "invalid_plan", response
        assert response["error"]["details"]["problems"] == [
            {"problem": "unordered_writes", "calls": ["call_1", "call_3"], "resources": ["counter:ctr_oa"]}]
        status, response = await stack.post("/v1/openai/tool-calls", {**body, "order": "list"}, headers=run)
        assert status == 200
        envelopes_ = envelopes(response)
        assert [e["call_id"] for e in envelopes_] == ["call_1", "call_2", "call_3", "call_4"]
        assert envelopes_[0]["data"] == {"counter": "ctr_oa", "value": 1}
        assert envelopes_[1]["error"]["code"] == "invalid_json"
        assert envelopes_[2]["data"] == {"counter": "ctr_oa", "value": 11}
        assert envelopes_[3]["error"]["code"] == "tool_not_found"
        assert envelopes_[3]["error"]["details"]["did_you_mean"] == "get_counter"
        model_view = json.loads(response["messages"][3]["content"])  # what the model reads names the tool
        assert model_view["error"]["message"].endswith('Did you mean "get_counter"?')
        assert response["batch"]["status"] == "partially_succeeded"


async def test_responses_function_calls_come_back_as_function_call_outputs(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        items = [
            ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                                  content=[ResponseOutputText(type="output_text", text="Checking.", annotations=[])]),
            ResponseFunctionToolCall(type="function_call", id="fc_1", call_id="call_r1", name="get_order",
                                     arguments=json.dumps({"order_id": "ord_1001"}), status="completed"),
            ResponseFunctionToolCall(type="function_call", id="fc_2", call_id="call_r2", name="refund_order",
                                     arguments=json.dumps({"order_id": "ord_1001", "amount": "5", "reason": "x"})),
        ]
        body = {"output": [item.model_dump(mode="json", exclude_none=True) for item in items]}
        status, response = await stack.post("/v1/openai/tool-calls", body)
        assert status == 200, response
        outputs = [CALL_OUTPUT.validate_python(item) for item in response["items"]]
        assert [o["type"] for o in outputs] == ["function_call_output"] * 2
        assert [o["call_id"] for o in outputs] == ["call_r1", "call_r2"]
        first, second = response["envelopes"]
        for envelope, output in zip((first, second), outputs):
            assert_envelope(envelope)
            assert json.loads(output["output"])["outcome"] == envelope["outcome"]
        assert first["outcome"] == "succeeded"
        assert second["error"]["code"] == "schema_violation"
        assert stack.backend.effect_counts().get("refund_order", 0) == 0


async def test_malformed_turns_are_refused_before_anything_runs(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        twice = assistant(chat_call("call_same", "get_order", {"order_id": "ord_1001"}),
                          chat_call("call_same", "get_order", {"order_id": "ord_1001"}))
        status, response = await stack.post("/v1/openai/tool-calls", twice)
        assert (status, response["error"]["code"]) == (400, "invalid_request")
        for bad in ({"tool_calls": []}, {"tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "get_order", "arguments": {}}}]},
                    {"output": [{"type": "message"}]}, {"tool_calls": [], "output": []},
                    {"output": [{"type": "function_call", "call_id": "bad id!", "name": "x", "arguments": "{}"}]}):
            status, response = await stack.post("/v1/openai/tool-calls", bad)
            assert (status, response["error"]["code"]) == (400, "invalid_request"), bad
        assert not [r for r in stack.backend.requests if r["tool"] == "get_order"]


async def test_the_model_reads_a_compact_view_and_programs_the_whole_envelope(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, response = await stack.post("/v1/openai/tool-calls", assistant(
            chat_call("call_1", "get_order", {"order_id": "ord_1001"}),
            chat_call("call_2", "get_order", {"order_id": "nope"})))
        assert status == 200
        [message_ok, message_bad] = tool_messages(response)
        ok, bad = json.loads(message_ok["content"]), json.loads(message_bad["content"])
        assert ok == {"outcome": "succeeded", "data": response["envelopes"][0]["data"]}
        assert set(bad) == {"outcome", "error"} and bad["error"]["code"] == "schema_violation"
        assert set(bad["error"]) == {"code", "message", "retryable", "resolution"}
        full = json.dumps(response["envelopes"][0], separators=(",", ":"))
        assert len(message_ok["content"]) * 2 < len(full)  # timing, digests and ids stay with the programs
