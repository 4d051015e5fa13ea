"""The tool-call and reasoning path on the real vocabularies and special-token tables of Llama 3.1, Qwen 3.5,
Gemma 4 and Mistral (tests/real_vocab.py says where each comes from): a call the family's template writes,
sampled as the family's ids, is decoded with its markers, parsed, not called nonsense, handed to the agent
without markers, and the next prompt is built from the exact ids."""

from __future__ import annotations

import asyncio
import json

import pytest
from real_vocab import end_of_turn_ids

from astuner.engine.base import GenerateResult
from astuner.model_tuner import ChatRenderer, ModelTuner, TunerLimits, detect_formats
from astuner.model_tuner.formats import REASONING_PARSERS, template_source
from astuner.model_tuner.pipeline_check import assistant_turn_text, check_pipeline
from astuner.model_tuner.tool_parser import TOOL_PARSERS, Gemma4ToolParser

# family -> (tool parser, reasoning parser, whether a tool result's prompt extends the call's exact ids)
EXPECTED = {
    "llama3.1": ("llama3_json", "none", True),
    "qwen3.5": ("qwen3_coder", "think", True),
    # Gemma 4's generation prompt opens an empty thought channel that the rendered turn leaves out: its prompts
    # are rendered afresh (never wrong, just not mergeable).
    "gemma4": ("gemma4", "channel", False),
    "mistral": ("mistral", "none", True),
}
# Markers each family writes as special tokens (skip_special_tokens would drop them) or as plain added tokens.
MARKERS = {
    "llama3.1": {"<|python_tag|>": True, "<|eom_id|>": True},
    "qwen3.5": {"<tool_call>": False, "<think>": False, "<|im_start|>": True},
    "gemma4": {"<|tool_call>": False, '<|"|>': False, "<|tool>": True, "<|turn>": True},
    "mistral": {"[TOOL_CALLS]": True, "[INST]": True},
}
# The token that ends a turn holding a tool call, as the family's template writes it.
CALL_END = {"llama3.1": "<|eot_id|>", "qwen3.5": "<|im_end|>", "gemma4": "<|tool_response>", "mistral": "</s>"}
# A control token that must still count as leaked when the model writes it inside an answer.
LEAK = {"llama3.1": "<|start_header_id|>", "qwen3.5": "<|im_start|>", "gemma4": "<|turn>", "mistral": "[INST]"}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The code of a name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "digits": {"type": "integer"}},
                   "required": ["name"]}}}
ARGS = {"name": "Ada Lovelace", "digits": 4}


class ReplayEngine:
    """Returns the given response ids, as a sampling engine would have produced them."""

    def __init__(self, responses: list[list[int]]) -> None:
        self.responses = list(responses)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.prompts.append(list(prompt_ids))
        ids = self.responses.pop(0)
        return GenerateResult(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop")

    def abort(self, request_id):
        pass


def _tuner(family, tok, responses):
    tool, reasoning, _ = EXPECTED[family]
    engine = ReplayEngine(responses)
    tuner = ModelTuner(engine, tok, ChatRenderer(tok, "template"), TOOL_PARSERS[tool](),
                       TunerLimits(8192, 512, 4096, 4096), 1.0, end_of_turn_ids(family, tok),
                       reasoning_parser=REASONING_PARSERS[reasoning]())
    return tuner, engine


def _sampled_call(family, tok) -> list[int]:
    """The ids a model of the family samples for a `lookup` call: the template's own text for that turn,
    tokenized, then the end-of-turn token the model generates."""
    messages = [{"role": "user", "content": "What is the code of Ada Lovelace?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "abcDEF123", "type": "function",
                     "function": {"name": "lookup", "arguments": json.dumps(ARGS)}}]}]
    stops = tuple(tok.convert_ids_to_tokens(list(end_of_turn_ids(family, tok))))
    text = assistant_turn_text(ChatRenderer(tok, "template"), messages, 1, [LOOKUP], stops)
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(CALL_END[family])]


@pytest.mark.parametrize("family", list(EXPECTED))
def test_the_families_own_special_token_tables(family, real_tokenizers):
    tok = real_tokenizers[family]
    special = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    assert {m: special.get(m) for m in MARKERS[family]} == MARKERS[family]
    fmt = detect_formats(template_source(tok), uses_builtin_tool_prompt=False)
    assert (fmt.tool_parser, fmt.reasoning_parser) == EXPECTED[family][:2]


@pytest.mark.parametrize("family", list(EXPECTED))
def test_a_sampled_tool_call_is_parsed_with_its_markers_and_the_next_prompt_reuses_its_ids(family, real_tokenizers):
    tok = real_tokenizers[family]
    call_ids = _sampled_call(family, tok)
    answer_ids = tok.encode("The code is 8812.", add_special_tokens=False) + [end_of_turn_ids(family, tok)[0]]
    tuner, engine = _tuner(family, tok, [call_ids, answer_ids])
    messages = [{"role": "user", "content": "What is the code of Ada Lovelace?"}]

    async def episode():
        first = await tuner.chat(messages, [LOOKUP])
        messages.append(first)
        messages.append({"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "name": "lookup",
                         "content": "8812"})
        return first, await tuner.chat(messages, [LOOKUP])

    first, second = asyncio.run(episode())
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]] == [
        ("lookup", ARGS)]
    recorded = tuner.calls[0]
    assert recorded.flags == [] and not recorded.tool_call_parse_failed, tuner.flag_reasons
    assert recorded.response_ids == call_ids  # trained on exactly what was sampled
    # What the agent sees carries no marker (as the family's server, decoding with skip_special_tokens, shows).
    shown = first["content"] + second["content"]
    assert not any(marker in shown for marker, is_special in MARKERS[family].items() if is_special)
    assert second["content"] == "The code is 8812." and tuner.calls[1].flags == []
    extends = EXPECTED[family][2]
    assert tuner.calls[1].extends_previous == extends
    if extends:
        assert engine.prompts[1][: len(engine.prompts[0]) + len(call_ids)] == engine.prompts[0] + call_ids


@pytest.mark.parametrize("family", list(EXPECTED))
def test_a_leaked_control_token_is_still_nonsense(family, real_tokenizers):
    tok = real_tokenizers[family]
    leak = tok.convert_tokens_to_ids(LEAK[family])
    ids = tok.encode("The code is", add_special_tokens=False) + [leak] + tok.encode(
        " 8812.", add_special_tokens=False) + [end_of_turn_ids(family, tok)[0]]
    tuner, _ = _tuner(family, tok, [ids])
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "Code?"}]))
    assert tuner.calls[0].flags == ["nonsense"]
    assert LEAK[family] not in reply["content"]


@pytest.mark.parametrize("family", list(EXPECTED))
def test_preflight_passes_on_the_real_vocabulary(family, real_tokenizers):
    tok = real_tokenizers[family]
    fmt = detect_formats(template_source(tok), False)
    tool, reasoning, extends = EXPECTED[family]
    stops = tuple(tok.convert_ids_to_tokens(list(end_of_turn_ids(family, tok))))
    rows = check_pipeline(ChatRenderer(tok, "template"), fmt, TOOL_PARSERS[tool](), REASONING_PARSERS[reasoning](),
                          stops, logprob_check=lambda: (1e-6, 16))
    assert {r.name: r.ok for r in rows if r.name != "extension"} == {
        "template": True, "tool parser": True, "logprobs": True, **({"reasoning": True} if reasoning != "none" else {})
    }, rows


def test_llama_python_tag_call_is_read_and_hidden(real_tokenizers):
    """Llama 3.1 models often open a JSON call with <|python_tag|> (a special token) and end it with <|eom_id|>."""
    tok = real_tokenizers["llama3.1"]
    ids = tok.encode('<|python_tag|>{"name": "lookup", "parameters": {"name": "Ada Lovelace", "digits": 4}}',
                     add_special_tokens=False) + [tok.convert_tokens_to_ids("<|eom_id|>")]
    assert tok.convert_tokens_to_ids("<|python_tag|>") in ids
    tuner, _ = _tuner("llama3.1", tok, [ids])
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "Code of Ada Lovelace?"}], [LOOKUP]))
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == ARGS
    assert tuner.calls[0].flags == [] and reply["content"] == ""
    assert tuner.calls[0].response_text.startswith("<|python_tag|>")  # the log shows what was sampled


def test_gemma4_parser_values():
    parser = Gemma4ToolParser()
    q = '<|"|>'
    text = (f"Let me look.<|tool_call>call:lookup{{name:{q}Ada, Countess{q},digits:4,exact:true,"
            f"tags:[{q}a{q},2],opts:{{deep:null}}}}<tool_call|>")
    parsed = parser.parse(text, {"lookup"})
    assert parsed.errors == [] and parsed.content == "Let me look."
    assert parsed.tool_calls[0].arguments == {"name": "Ada, Countess", "digits": 4, "exact": True,
                                              "tags": ["a", 2], "opts": {"deep": None}}
    broken = parser.parse(f"<|tool_call>call:lookup{{name:{q}Ada}}<tool_call|>", {"lookup"})
    assert broken.tool_calls == [] and "unclosed" in broken.errors[0]
    assert parser.parse("<|tool_call>call:lookup{", {"lookup"}).errors == [
        "unclosed <|tool_call> at the end of the output"]


def test_the_gguf_header_reader_reads_what_gguf_writes(tmp_path):
    """real_vocab.gguf_metadata (the vocabularies' reader, 30x faster than gguf.GGUFReader) against a file
    written by the gguf package itself: strings, scalars, arrays of strings and of numbers, non-ASCII text."""
    from gguf import GGUFWriter
    from real_vocab import gguf_metadata

    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "Ġhello", "é", "\u2581world", ""])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 6, 4])
    writer.add_array("tokenizer.ggml.merges", ["Ġ h", "e llo"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 7)
    writer.add_float32("rope.scale", 0.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = gguf_metadata(path)
    assert fields["tokenizer.ggml.tokens"] == ["<s>", "Ġhello", "é", "\u2581world", ""]
    assert fields["tokenizer.ggml.token_type"] == [3, 1, 1, 6, 4]
    assert fields["tokenizer.ggml.merges"] == ["Ġ h", "e llo"]
    assert (fields["tokenizer.ggml.model"], fields["general.architecture"]) == ("gpt2", "llama")
    assert (fields["tokenizer.ggml.eos_token_id"], fields["rope.scale"]) == (7, 0.5)
    assert fields["tokenizer.ggml.add_bos_token"] is True
