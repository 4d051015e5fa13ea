"""The OpenAI Responses endpoint (`/v1/responses`) through the `openai` SDK and the OpenAI Agents SDK's default
model: function calls, function-call outputs and reasoning items as the SDK's own types, streaming events, the
same exact-id recording and multi-turn extension as the Chat Completions route, and malformed bodies refused
with OpenAI's error shape before anything is recorded."""

from __future__ import annotations

import asyncio
import json

import agents
import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai.types import responses as rt
from test_model_tuner import ANSWER_TURN, TOOL_TURN, assert_recorded_exactly, make_tuner

from agents.models.openai_responses import OpenAIResponsesModel

from astuner.model_tuner.formats import ThinkReasoningParser
from astuner.model_tuner.frontends.gateway import Gateway
from astuner.types import GenerateResult

TOOLS = [{"type": "function", "name": "execute_python_code", "description": "Run Python code.",
          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}]
QUESTION = "What is 6*12?"
THOUGHT = "6 times 12, in Python"


async def _create(client, mode: str, **kw):
    """(the final Response, the stream's events) for one request, non-streaming or streaming."""
    if mode == "create":
        return await client.responses.create(**kw), []
    if mode == "stream":
        events = [event async for event in await client.responses.create(stream=True, **kw)]
        assert isinstance(events[-1], rt.ResponseCompletedEvent)
        return events[-1].response, events
    async with client.responses.stream(**kw) as stream:  # the SDK's helper, which accumulates the events
        events = [event async for event in stream]
        return await stream.get_final_response(), events


def _assert_events_build_the_response(events, final) -> None:
    assert isinstance(events[0], rt.ResponseCreatedEvent) and isinstance(events[1], rt.ResponseInProgressEvent)
    assert isinstance(events[-1], rt.ResponseCompletedEvent)  # the helper's own subclasses included
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if isinstance(e, rt.ResponseOutputItemDoneEvent)]
    assert [i.model_dump(exclude_none=True) for i in done] == [i.model_dump(exclude_none=True) for i in final.output]
    text = "".join(e.delta for e in events if isinstance(e, rt.ResponseTextDeltaEvent))
    assert text == final.output_text
    arguments = [e.delta for e in events if isinstance(e, rt.ResponseFunctionCallArgumentsDeltaEvent)]
    assert arguments == [item.arguments for item in final.output if item.type == "function_call"]
    assert any(isinstance(e, rt.ResponseOutputItemAddedEvent) for e in events)


@pytest.mark.parametrize("mode", ["create", "stream", "helper"])
def test_tool_call_round_trip_as_sdk_types_records_exact_ids_and_extends(demo_tokenizer, gateway, mode):
    tuner, engine = make_tuner(demo_tokenizer, [f"<think>\n{THOUGHT}\n</think>\n\n{TOOL_TURN}", ANSWER_TURN],
                               gateway=gateway, reasoning_parser=ThinkReasoningParser())

    async def main():
        # In-process for plain calls; over the loopback HTTP server when streaming.
        client = (tuner.get_openai_client() if mode == "create" else
                  openai.AsyncOpenAI(base_url=tuner.base_url, api_key=tuner.api_key, max_retries=0))
        first, first_events = await _create(client, mode, model="policy", instructions="Use tools.",
                                            input=QUESTION, tools=TOOLS)
        call = next(item for item in first.output if item.type == "function_call")
        history = ([{"role": "user", "content": QUESTION}]
                   + [item.model_dump(exclude_none=True) for item in first.output]
                   + [{"type": "function_call_output", "call_id": call.call_id, "output": "72"}])
        second, second_events = await _create(client, mode, model="policy", instructions="Use tools.",
                                              input=history, tools=TOOLS, store=False)
        return first, first_events, second, second_events

    first, first_events, second, second_events = asyncio.run(main())
    # The SDK's own types, and a body its models validate strictly (the client only constructs them).
    assert isinstance(first, rt.Response) and rt.Response.model_validate(first.to_dict())
    reasoning, message, call = first.output
    assert isinstance(reasoning, rt.ResponseReasoningItem) and reasoning.content[0].text == THOUGHT
    assert isinstance(message, rt.ResponseOutputMessage) and first.output_text == "I will compute it."
    assert isinstance(call, rt.ResponseFunctionToolCall)
    assert (call.name, json.loads(call.arguments)) == ("execute_python_code", {"code": "print(6*12)"})
    assert first.status == "completed" and first.usage.output_tokens == len(tuner.calls[0].response_ids)
    assert second.output_text == ANSWER_TURN and [item.type for item in second.output] == ["message"]
    if mode != "create":
        _assert_events_build_the_response(first_events, first)
        _assert_events_build_the_response(second_events, second)
    # The output items came back as input items; the prompt still reuses the first call's exact ids.
    assert tuner.calls[1].extends_previous
    prefix = tuner.calls[0].prompt_ids + tuner.calls[0].response_ids
    assert tuner.calls[1].prompt_ids[: len(prefix)] == prefix
    assert "<tool_response>\n72\n</tool_response>" in demo_tokenizer.decode(tuner.calls[1].prompt_ids)
    assert_recorded_exactly(tuner, engine)


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_default_model_calls_a_tool_and_finishes(demo_tokenizer, gateway, streamed):
    tuner, engine = make_tuner(demo_tokenizer, [
        f"<think>\n{THOUGHT}\n</think>\n\nLooking it up.\n<tool_call>\n"
        '{"name": "lookup_code", "arguments": {"name": "Ada Lovelace"}}\n</tool_call>',
        "The code of Ada Lovelace is 1815."], gateway=gateway, reasoning_parser=ThinkReasoningParser())
    looked_up = []

    @agents.function_tool
    def lookup_code(name: str) -> str:
        """The access code of a person, by full name."""
        looked_up.append(name)
        return "1815"

    async def main():
        agents.set_tracing_disabled(True)
        agents.set_default_openai_client(tuner.get_openai_client(), use_for_tracing=False)
        # No model class named and no API chosen: the SDK's default path.
        agent = agents.Agent(name="codes", instructions="Answer with the code.", model="policy",
                             tools=[lookup_code])
        model = agents.MultiProvider().get_model(agent.model)
        if not streamed:
            return model, await agents.Runner.run(agent, "What is Ada Lovelace's code?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "What is Ada Lovelace's code?", max_turns=4)
        assert [event async for event in result.stream_events()]
        return model, result

    try:
        model, result = asyncio.run(main())
    finally:
        agents.set_default_openai_client(None, use_for_tracing=False)  # the SDK's global, as it starts
    assert isinstance(model, OpenAIResponsesModel)  # the default path, not OpenAIChatCompletionsModel
    assert looked_up == ["Ada Lovelace"] and result.final_output == "The code of Ada Lovelace is 1815."
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)  # served by /v1/responses
    assert len(tuner.calls) == 2 and tuner.calls[1].extends_previous
    assert "1815" in demo_tokenizer.decode(tuner.calls[1].prompt_ids)
    assert_recorded_exactly(tuner, engine)


def test_a_turn_cut_by_the_token_limit_is_incomplete_as_openai_answers_it(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, ["one two three four five six"], gateway=gateway)
    scripted = engine.generate

    async def cut(prompt_ids, sampling, request_id=None):  # the engine stops at max_tokens, no eos
        result = await scripted(prompt_ids, sampling, request_id)
        return GenerateResult(result.token_ids[:-1], result.logprobs[:-1], "length")

    engine.generate = cut

    async def main():
        stream = await tuner.get_openai_client().responses.create(model="p", input=QUESTION, max_output_tokens=3,
                                                                  stream=True)
        return [event async for event in stream]

    events = asyncio.run(main())
    assert isinstance(events[-1], rt.ResponseIncompleteEvent)
    final = events[-1].response
    assert (final.status, final.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert final.output[0].status == "incomplete" and final.output_text == "one two"
    assert len(tuner.calls[0].response_ids) == 2  # max_output_tokens honoured


MALFORMED = [
    (b"\xff\xfe\xfa not utf-8", "UTF-8"),
    (b"{not json", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ([{"input": "hi"}], "JSON object"),
    ({"model": "p"}, "'input'"),
    ({"input": []}, "'input'"),
    ({"input": [1]}, "input[0]"),
    ({"input": [{"type": [], "role": "user"}]}, "input[0].type"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "robot"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input_file"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "summary[0]"),
    ({"input": "hi", "instructions": ["be brief"]}, "instructions"),
    ({"input": "hi", "tools": [1]}, "tools"),
    ({"input": "hi", "tools": [{"type": "web_search"}, {"type": "file_search"}]}, "file_search, web_search"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "search"}}, "'search'"),
    ({"input": "hi", "tool_choice": "required"}, "offers none"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "send the whole conversation"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "json_schema"),
    ({"input": "hi", "text": "plain"}, "text"),
    ({"input": "hi", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "metadata": {"n": 1}}, "metadata"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"},
                {"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"properties": [1]}}]},
     "tools[0].parameters.properties"),
]


def _post(gateway: Gateway, key: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def main():
        transport = httpx.ASGITransport(app=gateway.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://astuner.local") as http:
            return await http.post("/v1/responses", content=content,
                                   headers={"authorization": f"Bearer {key}", "content-type": "application/json"})

    return asyncio.run(main())


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["type"] and "code" in error and "param" in error
    return error


@pytest.mark.parametrize("body,named", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_malformed_body_gets_400_in_openai_shape_naming_the_problem_and_records_nothing(
        demo_tokenizer, gateway, body, named):
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN], gateway=gateway)
    error = _assert_openai_error(_post(gateway, tuner.api_key, body), 400)
    assert named in error["message"]
    assert tuner.calls == [] and engine.prompts == []


def test_a_wrong_key_gets_401_and_the_sdk_raises_its_own_errors(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN], gateway=gateway)
    _assert_openai_error(_post(gateway, "nope", {"input": "hi"}), 401)

    async def main():
        with pytest.raises(openai.BadRequestError, match="web_search"):
            await tuner.get_openai_client().responses.create(model="p", input="hi", tools=[{"type": "web_search"}])

    asyncio.run(main())
    assert tuner.calls == []


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=3), max_leaves=8)
_ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "summary", "text"]
_ITEM = st.dictionaries(st.sampled_from(_ITEM_KEYS),
                        _JSON | st.sampled_from(["message", "user", "assistant", "function_call", "reasoning",
                                                 "function_call_output", "input_text", "f"]), max_size=5)
_FIELDS = ["input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "stream", "store",
           "parallel_tool_calls", "reasoning", "metadata", "text", "top_p", "previous_response_id"]
_GOOD_ITEMS = st.sampled_from([
    {"role": "user", "content": "hi"},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "1"},
])
_GOOD_FIELDS = {
    "tools": st.just([{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "max_output_tokens": st.integers(-1, 40), "temperature": st.floats(-1, 3), "stream": st.booleans(),
    "instructions": st.text(max_size=5), "text": st.just({"format": {"type": "text"}}),
    "metadata": st.just({"k": "v"}), "reasoning": st.just({"effort": "low"}), "store": st.booleans(),
}
# Mostly well-formed bodies with some parts broken, then free-form ones.
_NEAR = st.fixed_dictionaries(
    {"input": st.lists(_GOOD_ITEMS | _ITEM, min_size=1, max_size=4) | st.text(max_size=5)},
    optional={key: value | _JSON for key, value in _GOOD_FIELDS.items()})
_BODY = _NEAR | st.dictionaries(st.sampled_from(_FIELDS), _JSON | st.lists(_ITEM, max_size=3) | st.text(max_size=5),
                                max_size=6) | _JSON


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODY)
def test_fuzzed_bodies_are_answered_or_refused_with_400_never_500_and_refusals_record_nothing(demo_tokenizer, body):
    gateway = Gateway()
    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN] * 2, gateway=gateway)
    response = _post(gateway, tuner.api_key, body)
    event(f"status {response.status_code}")
    if response.status_code == 200:
        assert len(tuner.calls) == 1 and rt.Response.model_validate(
            _final_event(response.text) if body.get("stream") is True else response.json())
    else:
        _assert_openai_error(response, 400)
        assert tuner.calls == []


def _final_event(text: str) -> dict:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return json.loads(data[-1])["response"]


_TWO_CALLS = (f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
              '{"name": "execute_python_code", "arguments": {"code": "print(6*12)"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "execute_python_code", "arguments": {"code": "print(12*6)"}}\n</tool_call>')


def _outputs_listed(shape: str, items: list[dict]) -> list[dict]:
    """A turn's output items with their calls' outputs: after all of them (the Agents SDK's shape) or each
    right after its call (how some harnesses list them)."""
    out = []
    for item in items:
        out.append(item)
        if item["type"] == "function_call" and shape == "each after its call":
            out.append({"type": "function_call_output", "call_id": item["call_id"], "output": "72"})
    if shape == "all after the calls":
        out += [{"type": "function_call_output", "call_id": item["call_id"], "output": "72"}
                for item in items if item["type"] == "function_call"]
    return out


@pytest.mark.parametrize("shape", ["all after the calls", "each after its call"])
def test_parallel_calls_sent_back_in_either_order_extend_the_recorded_call_exactly(demo_tokenizer, gateway, shape):
    tuner, engine = make_tuner(demo_tokenizer, [_TWO_CALLS, ANSWER_TURN], gateway=gateway,
                               reasoning_parser=ThinkReasoningParser())

    async def main():
        client = tuner.get_openai_client()
        first = await client.responses.create(model="p", input=QUESTION, tools=TOOLS)
        items = [item.model_dump(exclude_none=True) for item in first.output]
        history = [{"role": "user", "content": QUESTION}] + _outputs_listed(shape, items)
        await client.responses.create(model="p", input=history, tools=TOOLS)
        return first

    first = asyncio.run(main())
    assert [item.type for item in first.output] == ["reasoning", "function_call", "function_call"]
    # One answer's two calls are one assistant turn again: the prompt goes on from the recorded ids.
    prefix = tuner.calls[0].prompt_ids + tuner.calls[0].response_ids
    assert tuner.calls[1].extends_previous and tuner.calls[1].prompt_ids[: len(prefix)] == prefix
    assert_recorded_exactly(tuner, engine)


def test_calls_of_successive_turns_listed_each_after_its_output_stay_separate_turns(demo_tokenizer, gateway):
    """The same item shape as above, but the model saw the first output before making the second call."""
    call_only = TOOL_TURN.removeprefix("I will compute it.\n")  # no text: each answer is one function_call item
    tuner, engine = make_tuner(demo_tokenizer, [call_only, call_only.replace("6*12", "12*6"), ANSWER_TURN],
                               gateway=gateway)

    async def main():
        client = tuner.get_openai_client()
        history: list = [{"role": "user", "content": QUESTION}]
        for _ in range(3):
            response = await client.responses.create(model="p", input=history, tools=TOOLS)
            history += _outputs_listed("each after its call",
                                       [item.model_dump(exclude_none=True) for item in response.output])
        return history

    history = asyncio.run(main())
    assert [item.get("type") for item in history[1:]] == ["function_call", "function_call_output"] * 2 + ["message"]
    for before, after in zip(tuner.calls, tuner.calls[1:]):
        prefix = before.prompt_ids + before.response_ids
        assert after.extends_previous and after.prompt_ids[: len(prefix)] == prefix
    assert_recorded_exactly(tuner, engine)
