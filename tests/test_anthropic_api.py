"""The Anthropic Messages endpoint (`/v1/messages`) through the `anthropic` SDK: tool_use and tool_result
blocks, thinking blocks, streaming events, errors, and the same exact-id recording and multi-turn extension as
the OpenAI route."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from real_vocab import end_of_turn_ids
from test_model_tuner import ANSWER_TURN, TOOL_TURN, assert_recorded_exactly, make_tuner
from test_real_vocabularies import _tuner as family_tuner

from astuner.model_tuner.frontends.anthropic_api import to_openai_tools
from astuner.model_tuner.chat_format import ChatRenderer, normalize_ids
from astuner.model_tuner.frontends.gateway import Gateway
from astuner.model_tuner.formats import ThinkReasoningParser

TOOLS = [{"name": "execute_python_code", "description": "Run Python code.",
          "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}]
QUESTION = [{"role": "user", "content": "What is 6*12?"}]
RUN = {"name": "run", "description": "Run Python code.",
       "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}



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


def test_a_final_assistant_message_is_a_prefill_the_answer_continues_token_exactly(demo_tokenizer, gateway):
    continuation = " 72, since six twelves are seventy-two."
    tuner, engine = make_tuner(demo_tokenizer, [continuation, ANSWER_TURN], gateway=gateway)
    prefill = "The answer is"

    async def main():
        client = tuner.get_anthropic_client()
        first = await client.messages.create(model="p", max_tokens=64,
                                             messages=[*QUESTION, {"role": "assistant", "content": prefill}])
        # As clients send it back: the prefill and its continuation, one assistant turn.
        history = [*QUESTION, {"role": "assistant", "content": prefill + first.content[0].text},
                   {"role": "user", "content": "And 7*8?"}]
        await client.messages.create(model="p", max_tokens=64, messages=history)
        return first

    first = asyncio.run(main())
    assert first.content[0].text == continuation  # only the continuation, as Anthropic's API answers
    prefill_ids = demo_tokenizer.encode(prefill, add_special_tokens=False)
    call = tuner.calls[0]
    # The generation prompt, then the prefill's tokens: one assistant turn, begun and not closed.
    assert call.prompt_ids == ChatRenderer(demo_tokenizer).render(QUESTION) + prefill_ids
    assert demo_tokenizer.decode(call.prompt_ids).endswith("<|im_start|>assistant\n" + prefill)
    assert demo_tokenizer.decode(call.prompt_ids).count("<|im_start|>assistant") == 1
    assert demo_tokenizer.decode(call.prompt_ids + call.response_ids, skip_special_tokens=True).endswith(
        prefill + continuation)
    # The next turn extends the prefilled one with its exact ids.
    later = tuner.calls[1]
    assert later.extends_previous and later.prompt_ids[: len(call.prompt_ids) + len(call.response_ids)] == (
        call.prompt_ids + call.response_ids)
    assert_recorded_exactly(tuner, engine)


# family -> (the continuation sampled after the prefill, the next turn's new messages, the tools offered).
# Qwen3.5's template keeps a finished turn as written only until the next user message (it drops the <think>
# block of older turns), so there the turn is continued by a tool call and the next turn is its result.
_QWEN_CALL = "\n\n<tool_call>\n<function=run>\n<parameter=code>\n6*12\n</parameter>\n</function>\n</tool_call>"
_NEXT_USER = [{"role": "user", "content": "And 7*8?"}]
PREFILL_TURNS = {
    "llama3.1": (" 72, since six twelves are seventy-two.", _NEXT_USER, []),
    "qwen3.5": (_QWEN_CALL, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "{id}",
                                                            "content": "72"}]}], [RUN]),
    "gemma4": (" 72, since six twelves are seventy-two.", _NEXT_USER, []),
    "mistral": (" 72, since six twelves are seventy-two.", _NEXT_USER, []),
}


@pytest.mark.parametrize("family", list(PREFILL_TURNS))
@pytest.mark.slow
def test_a_prefill_continues_the_turn_as_each_family_template_writes_it_and_the_next_turn_extends_it(
        family, real_tokenizers):
    """The prefill follows what the template writes for a finished assistant turn (transformers'
    continue_final_message): on Qwen3.5 after the closed empty <think> block, not inside the generation prompt's
    open one, where the model would read the prefill as its reasoning."""
    tokenizer = real_tokenizers[family]
    continuation, after, tools = PREFILL_TURNS[family]
    sampled = tokenizer.encode(continuation, add_special_tokens=False) + [end_of_turn_ids(family, tokenizer)[0]]
    answer = tokenizer.encode("It is 56.", add_special_tokens=False) + [end_of_turn_ids(family, tokenizer)[0]]
    tuner, engine = family_tuner(family, tokenizer, [sampled, answer])
    tuner.gateway = Gateway()
    prefill = "The answer is"

    async def main():
        client = tuner.get_anthropic_client()
        first = await client.messages.create(model="p", max_tokens=64, tools=tools,
                                             messages=[*QUESTION, {"role": "assistant", "content": prefill}])
        # As clients send it back: the prefill and its continuation, one assistant turn.
        blocks = [b.model_dump(exclude_none=True) for b in first.content]
        blocks = [{"type": "text", "text": prefill + (blocks[0]["text"] if blocks[0]["type"] == "text" else "")},
                  *(b for b in blocks if b["type"] == "tool_use")]
        ids = [b["id"] for b in blocks if b["type"] == "tool_use"]
        later = json.loads(json.dumps(after).replace("{id}", ids[0] if ids else ""))
        await client.messages.create(model="p", max_tokens=64, tools=tools,
                                     messages=[*QUESTION, {"role": "assistant", "content": blocks}, *later])

    asyncio.run(main())
    call, later = tuner.calls
    assert call.response_ids == sampled and (family != "qwen3.5" or call.reply["tool_calls"])
    template_tools = tuner.renderer.prepare(QUESTION, to_openai_tools({"tools": tools})[0])[1]
    expected = normalize_ids(tokenizer.apply_chat_template([*QUESTION, {"role": "assistant", "content": prefill}],
                                                           tools=template_tools, continue_final_message=True,
                                                           tokenize=True))
    assert call.prompt_ids == expected, tokenizer.decode(call.prompt_ids[-12:])
    assert tokenizer.decode(call.prompt_ids).endswith(prefill)
    assert later.extends_previous and later.prompt_ids[: len(call.prompt_ids) + len(call.response_ids)] == (
        call.prompt_ids + call.response_ids)


def test_count_tokens_counts_the_prompt_a_call_would_get_and_records_nothing(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)
    prefill = [{"role": "assistant", "content": "The answer is"}]

    async def main():
        client = tuner.get_anthropic_client()
        plain = await client.messages.count_tokens(model="p", system="Use tools.", messages=QUESTION, tools=TOOLS)
        prefilled = await client.messages.count_tokens(model="p", messages=QUESTION + prefill)
        wrong = anthropic.AsyncAnthropic(base_url=tuner.anthropic_base_url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.count_tokens(model="p", messages=QUESTION)
        return plain, prefilled

    plain, prefilled = asyncio.run(main())
    renderer = ChatRenderer(demo_tokenizer)
    chat = [{"role": "system", "content": "Use tools."}, *QUESTION]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    assert plain.input_tokens == len(renderer.render(chat, tools))
    assert prefilled.input_tokens == len(renderer.render(QUESTION)) + len(
        demo_tokenizer.encode("The answer is", add_special_tokens=False))
    assert tuner.calls == []


def test_stop_sequences_as_a_string_is_refused_not_split_into_letters(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, ["Nine ENDS here"], gateway=gateway)

    async def main():
        with pytest.raises(anthropic.BadRequestError, match="'stop_sequences' must be a list of strings"):
            await tuner.get_anthropic_client().messages.create(model="p", max_tokens=64, messages=QUESTION,
                                                               stop_sequences="END")

    asyncio.run(main())
    assert tuner.calls == []


def test_image_and_document_blocks_are_refused_naming_the_block(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN], gateway=gateway)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}

    async def main():
        client = tuner.get_anthropic_client()
        for block in (image, document):
            with pytest.raises(anthropic.BadRequestError, match=f"'{block['type']}' blocks are refused"):
                await client.messages.create(model="p", max_tokens=64, messages=[{"role": "user", "content": [
                    block]}])

    asyncio.run(main())
    assert tuner.calls == []


def test_models_accepts_the_anthropic_key_header(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://t") as http:
            ok = await http.get("/v1/models", headers={"x-api-key": tuner.api_key})
            wrong = await http.get("/v1/models", headers={"x-api-key": "nope"})
        return ok, wrong

    ok, wrong = asyncio.run(main())
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == tuner.model_name
    assert wrong.status_code == 401
