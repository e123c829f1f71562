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


def tool_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = [TOOL_MESSAGE.validate_python(m) for m in body["messages"]]
    for message in messages:
        assert message["role"] == "tool"
        envelope = json.loads(message["content"])
        assert_envelope(envelope)
        assert envelope["call_id"] == message["tool_call_id"]
    return messages


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
        order, stock = (json.loads(m["content"]) for m in messages)
        assert order["outcome"] == "succeeded" and order["data"]["order_id"] == "ord_1001"
        assert stock["outcome"] == "succeeded" and stock["tool"] == "get_inventory"
        assert response["batch"]["status"] == "succeeded"


async def test_each_call_fails_on_its_own_and_writes_keep_request_order(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        body = assistant(chat_call("call_1", "adjust_counter", {"counter": "ctr_oa", "delta": 1}),
                         chat_call("call_2", "adjust_counter", '{"counter": "ctr_oa", "delta": 2'),
                         chat_call("call_3", "adjust_counter", {"counter": "ctr_oa", "delta": 10}),
                         chat_call("call_4", "no_such_tool", {}))
        run = {"X-Run-Id": "task-oa"}  # the business request the turn serves: the writes' key
        status, response = await stack.post("/v1/openai/tool-calls", body, headers=run)  # two writes, no order
        assert status == 400 and response["error"]["code"] == "invalid_plan", response
        assert response["error"]["details"]["problems"] == [
            {"problem": "unordered_writes", "calls": ["call_1", "call_3"], "resources": ["counter:ctr_oa"]}]
        status, response = await stack.post("/v1/openai/tool-calls", {**body, "order": "list"}, headers=run)
        assert status == 200
        envelopes = [json.loads(m["content"]) for m in tool_messages(response)]
        assert [e["call_id"] for e in envelopes] == ["call_1", "call_2", "call_3", "call_4"]
        assert envelopes[0]["data"] == {"counter": "ctr_oa", "value": 1}
        assert envelopes[1]["error"]["code"] == "invalid_json"
        assert envelopes[2]["data"] == {"counter": "ctr_oa", "value": 11}
        assert envelopes[3]["error"]["code"] == "tool_not_found"
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
        first, second = (json.loads(o["output"]) for o in outputs)
        for envelope in (first, second):
            assert_envelope(envelope)
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
