"""Chat formats by family on the families' real chat templates (Qwen2.5, Qwen3, Qwen3-Coder, Llama 3.1,
Mistral Nemo): detection, each parser reading what its template writes, reasoning, the preflight table, and
token-exact multi-turn prompts."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_model_tuner import ScriptedEngine

from astuner.errors import UserError
from astuner.model_tuner import ChatRenderer, ModelTuner, TunerLimits, detect_formats
from astuner.model_tuner.formats import REASONING_PARSERS, ThinkReasoningParser
from astuner.model_tuner.pipeline_check import check_pipeline, golden_conversation, run_preflight
from astuner.model_tuner.tool_parser import TOOL_PARSERS

# family -> (tool parser, reasoning parser, end-of-turn markers the model generates)
EXPECTED = {
    "qwen2.5": ("hermes", "none", ("<|im_end|>",)),
    "qwen3": ("hermes", "think", ("<|im_end|>",)),
    "qwen3_coder": ("qwen3_coder", "none", ("<|im_end|>",)),
    "llama3.1": ("llama3_json", "none", ("<|eot_id|>", "<|eom_id|>")),
    "mistral_nemo": ("mistral", "none", ("</s>",)),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizers(demo_model_dir, family_templates):
    """The demo vocabulary with each family's template (Mistral's eos set to its own </s>)."""
    from transformers import AutoTokenizer

    out = {}
    for family, source in family_templates.items():
        tok = AutoTokenizer.from_pretrained(demo_model_dir)
        tok.chat_template = source
        if family == "mistral_nemo":
            tok.add_special_tokens({"eos_token": "</s>"})
        out[family] = tok
    return out


def _parsers(family):
    tool, reasoning, _ = EXPECTED[family]
    return TOOL_PARSERS[tool](), REASONING_PARSERS[reasoning]()


@pytest.mark.parametrize("family", list(EXPECTED))
def test_detection_table_picks_the_family_parsers(family, family_templates):
    fmt = detect_formats(family_templates[family], uses_builtin_tool_prompt=False)
    assert (fmt.tool_parser, fmt.reasoning_parser) == EXPECTED[family][:2]
    assert fmt.how == "detected"
    # The config overrides the table; a template without tools gets the builtin prompt's parser.
    assert detect_formats(family_templates[family], False, "mistral", "none").tool_parser == "mistral"
    assert detect_formats("{{ messages }}", True).tool_parser == "hermes"


def _assistant_text(tok, messages, index, tools, stops):
    from astuner.model_tuner.pipeline_check import assistant_turn_text

    return assistant_turn_text(ChatRenderer(tok, "template"), messages, index, tools, stops)


@pytest.mark.parametrize("family", list(EXPECTED))
@pytest.mark.slow
def test_each_parser_reads_its_templates_own_tool_calls(family, tokenizers):
    """The template renders a past tool call; the family's parser must read it back exactly."""
    tok, (tool_parser, reasoning_parser), stops = tokenizers[family], _parsers(family), EXPECTED[family][2]
    calls = [("get_weather", {"city": "Paris", "days": 3})]
    if family != "llama3.1":  # Llama 3.1's template allows one call per turn
        calls.append(("get_time", {"city": "Oslo"}))
    messages = [
        {"role": "user", "content": "Weather and time, please."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)]},
    ]
    text = _assistant_text(tok, messages, 1, [WEATHER, CLOCK], stops)
    parsed = tool_parser.parse(reasoning_parser.split(text).content, {"get_weather", "get_time"})
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    # And a plain answer is content, not a call.
    plain = tool_parser.parse("The weather is fine.", {"get_weather"})
    assert plain.tool_calls == [] and plain.errors == [] and plain.content == "The weather is fine."


@pytest.mark.parametrize("family", list(EXPECTED))
def test_preflight_passes_on_the_real_template(family, tokenizers):
    tok = tokenizers[family]
    fmt = detect_formats(tok.chat_template, False)
    tool_parser, reasoning_parser = _parsers(family)
    rows = check_pipeline(ChatRenderer(tok, "template"), fmt, tool_parser, reasoning_parser, EXPECTED[family][2],
                          logprob_check=lambda: (1e-6, 16))
    # Mistral Nemo's template writes the system prompt into the last user turn only, so a conversation that
    # grows rewrites its earlier text: prompts cannot extend (reported, not fatal; they are rendered afresh).
    assert {r.name: r.ok for r in rows} == {
        "template": True, "tool parser": True, "extension": family != "mistral_nemo", "logprobs": True,
        **({"reasoning": True} if family == "qwen3" else {})}, rows


def test_preflight_catches_a_wrong_parser(tokenizers):
    tok = tokenizers["llama3.1"]
    fmt = detect_formats(tok.chat_template, False, tool_parser="hermes")
    args = (ChatRenderer(tok, "template"), fmt, TOOL_PARSERS["hermes"](), REASONING_PARSERS["none"](),
            EXPECTED["llama3.1"][2])
    with pytest.raises(UserError) as info:
        run_preflight("strict", *args)
    message = str(info.value)
    assert "tool parser  FAIL" in message and "tool_call_parser" in message
    rows = run_preflight("warn", *args)  # warn: the same finding, no stop
    assert [r.name for r in rows if not r.ok] == ["tool parser"]
    assert run_preflight("off", *args) == []
    # An engine/trainer gap fails the logprob row.
    rows = check_pipeline(*args[:4], args[4], logprob_check=lambda: (0.7, 16))
    assert not {r.name: r.ok for r in rows}["logprobs"]


def test_think_parser_cases():
    p = ThinkReasoningParser()
    assert (p.split("<think>\nplan\n</think>\n\nanswer").reasoning, p.split("<think>plan</think>answer").content) == (
        "plan", "answer")
    assert p.split("plan only</think>answer").reasoning == "plan only"  # template opened <think> itself
    cut = p.split("<think>never closed")
    assert (cut.reasoning, cut.content) == ("never closed", "")
    assert p.split("no thinking").reasoning is None


def _tuner(tok, script, reasoning=None):
    engine = ScriptedEngine(tok, script)
    tuner = ModelTuner(engine, tok, ChatRenderer(tok, "template"), TOOL_PARSERS["hermes"](),
                       TunerLimits(4096, 256, 2048, 2048), 1.0, (tok.convert_tokens_to_ids("<|im_end|>"),),
                       madness_checks=(), reasoning_parser=reasoning)
    return tuner, engine


TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_multi_turn_prompt_reuses_exact_ids_on_qwen25(tokenizers):
    tok = tokenizers["qwen2.5"]
    # The model's own spacing differs from what the template would write back: only exact reuse keeps it.
    tuner, engine = _tuner(tok, [TOOL_CALL.replace('{"name"', '{ "name"'), "It is sunny."])
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def episode():
        first = await tuner.chat(messages, [WEATHER])
        messages.append(first)
        messages.append({"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"})
        await tuner.chat(messages, [WEATHER])

    asyncio.run(episode())
    first, second = tuner.calls
    assert not first.extends_previous and second.extends_previous
    prefix = first.prompt_ids + first.response_ids
    assert second.prompt_ids[: len(prefix)] == prefix
    # The re-rendered prompt would have rewritten the model's turn: exact reuse is a real difference here.
    full = ChatRenderer(tok, "template").render(messages, [WEATHER])
    assert full != second.prompt_ids
    assert tok.decode(second.prompt_ids[len(prefix):]).startswith("\n<|im_start|>user\n<tool_response>\nsunny")


def test_a_changed_history_is_rendered_afresh(tokenizers):
    tok = tokenizers["qwen2.5"]
    tuner, _ = _tuner(tok, ["Hello!", "Fine."])
    messages = [{"role": "user", "content": "Hi"}]

    async def episode():
        reply = await tuner.chat(messages)
        reply["content"] = "Edited by the agent."  # the agent rewrote the model's turn
        await tuner.chat(messages + [reply, {"role": "user", "content": "How are you?"}])

    asyncio.run(episode())
    assert not tuner.calls[1].extends_previous
    assert tuner.calls[1].prompt_ids == ChatRenderer(tok, "template").render(
        messages + [{"role": "assistant", "content": "Edited by the agent."},
                    {"role": "user", "content": "How are you?"}])


def test_qwen3_new_user_turn_drops_reasoning_so_it_does_not_extend(tokenizers):
    """Qwen3's template drops the reasoning of turns before the last user message: a new user turn rewrites
    history, so that prompt is rendered afresh (never wrong, just not mergeable); a tool turn extends."""
    tok = tokenizers["qwen3"]
    tuner, _ = _tuner(tok, ["<think>\nneed weather\n</think>\n\n" + TOOL_CALL, "<think>\nok\n</think>\n\nSunny.",
                            "<think>\nbye\n</think>\n\nBye."], reasoning=ThinkReasoningParser())
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def episode():
        first = await tuner.chat(messages, [WEATHER])
        assert first["reasoning_content"] == "need weather"
        messages.extend([first, {"role": "tool", "tool_call_id": "x", "content": "sunny"}])
        messages.append(await tuner.chat(messages, [WEATHER]))
        messages.append({"role": "user", "content": "Thanks!"})
        await tuner.chat(messages, [WEATHER])

    asyncio.run(episode())
    assert [c.extends_previous for c in tuner.calls] == [False, True, False]


def test_golden_conversation_shape():
    convo = golden_conversation(with_reasoning=True)
    assert [m["role"] for m in convo] == ["system", "user", "assistant", "tool", "assistant"]
    assert convo[2]["reasoning_content"] and len(convo[2]["tool_calls"][0]["id"]) == 9
