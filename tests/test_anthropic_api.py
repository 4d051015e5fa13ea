"""The Anthropic Messages endpoint (`/v1/messages`) through the `anthropic` SDK: tool_use and tool_result
blocks, thinking blocks, streaming events, errors, and the same exact-id recording and multi-turn extension as
the OpenAI route."""

from __future__ import annotations

import asyncio

import anthropic
import pytest
from test_model_tuner import ANSWER_TURN, TOOL_TURN, assert_recorded_exactly, make_tuner

from astuner.model_tuner.formats import ThinkReasoningParser

TOOLS = [{"name": "execute_python_code", "description": "Run Python code.",
          "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}]
QUESTION = [{"role": "user", "content": "What is 6*12?"}]



async def _tool_round_trip(client, stream: bool):
    async def create(**kw):
        if not stream:
            return await client.messages.create(**kw)
        async with client.messages.stream(**kw) as events:
            return await events.get_final_message()

    first = await create(model="policy", max_tokens=256, system="Use tools.", messages=QUESTION, tools=TOOLS)
    use = next(b for b in first.content if b.type == "tool_use")
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "72"}]}]
    second = await create(model="policy", max_tokens=256, system="Use tools.", messages=history, tools=TOOLS)
    return first, second


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip_records_exact_ids_and_extends(demo_tokenizer, gateway, stream):
    tuner, engine = make_tuner(demo_tokenizer, [TOOL_TURN, ANSWER_TURN], gateway=gateway)

    async def main():
        client = (anthropic.AsyncAnthropic(base_url=tuner.anthropic_base_url, api_key=tuner.api_key, max_retries=0)
                  if stream else tuner.get_anthropic_client())
        return await _tool_round_trip(client, stream)

    first, second = asyncio.run(main())
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "I will compute it."
    assert (first.content[1].name, first.content[1].input) == ("execute_python_code", {"code": "print(6*12)"})
    assert first.usage.output_tokens == len(tuner.calls[0].response_ids)
    assert second.stop_reason == "end_turn" and second.content[0].text == ANSWER_TURN
    # The tool result came back as Anthropic blocks; the prompt still reuses the first call's exact ids.
    assert tuner.calls[1].extends_previous
    prefix = tuner.calls[0].prompt_ids + tuner.calls[0].response_ids
    assert tuner.calls[1].prompt_ids[: len(prefix)] == prefix
    assert "<tool_response>\n72\n</tool_response>" in demo_tokenizer.decode(tuner.calls[1].prompt_ids)
    assert_recorded_exactly(tuner, engine)


def test_thinking_blocks_stop_sequences_and_errors(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, ["<think>\n6 times 12\n</think>\n\nIt is 72.", "one two STOP three"],
                          gateway=gateway, reasoning_parser=ThinkReasoningParser())

    async def main():
        client = tuner.get_anthropic_client()
        thought = await client.messages.create(model="p", max_tokens=64, messages=QUESTION)
        stopped = await client.messages.create(model="p", max_tokens=64, messages=QUESTION, stop_sequences=["STOP"])
        with pytest.raises(anthropic.BadRequestError, match="'search'"):
            await client.messages.create(model="p", max_tokens=64, messages=QUESTION, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "search"})
        wrong = anthropic.AsyncAnthropic(base_url=tuner.anthropic_base_url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="p", max_tokens=64, messages=QUESTION)
        return thought, stopped

    thought, stopped = asyncio.run(main())
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in thought.content] == [
        ("thinking", "6 times 12"), ("text", "It is 72.")]
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "STOP",
                                                                                      "one two ")
    assert len(tuner.calls) == 2  # refused requests recorded nothing
