"""Tool-call parsing: Hermes' well-formed calls and every malformation reported as an error; for every family,
Gemma 4's quoting wherever whitespace stands, deep nesting reported instead of raised, and markers kept from the
agent. (tests/test_parser_fuzz.py fuzzes the same properties.)"""

from __future__ import annotations

import json

import pytest

from astuner.model_tuner.formats import ChannelReasoningParser, ThinkReasoningParser
from astuner.model_tuner.tool_parser import (
    MAX_NESTING,
    TOOL_PARSERS,
    Gemma4ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_parser,
)

TOOLS = {"search", "calc"}


@pytest.fixture()
def parser():
    return HermesToolParser()


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "mistral", "gemma4"}
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("llama3")


def test_plain_text(parser):
    out = parser.parse("  The answer is 42.  ", TOOLS)
    assert out.content == "The answer is 42." and out.tool_calls == [] and out.errors == []


def test_single_call(parser):
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "RL"}}\n</tool_call>'
    out = parser.parse(text, TOOLS)
    assert out.errors == []
    assert out.content == "Let me look."
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_0", "search", {"query": "RL"})


def test_multiple_calls_keep_order_and_text_between(parser):
    text = (
        'A <tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call> B '
        '<tool_call>{"name": "search", "arguments": {}}</tool_call> C'
    )
    out = parser.parse(text, TOOLS, id_prefix="call_3")
    assert [c.name for c in out.tool_calls] == ["calc", "search"]
    assert [c.id for c in out.tool_calls] == ["call_3_0", "call_3_1"]
    assert out.content == "A  B  C"
    assert out.errors == []


def test_invalid_json(parser):
    out = parser.parse('<tool_call>{"name": "calc", "arguments": {"expr": }</tool_call>', TOOLS)
    assert out.tool_calls == []
    assert len(out.errors) == 1 and "invalid JSON" in out.errors[0]


def test_unclosed_call(parser):
    out = parser.parse('Thinking <tool_call>{"name": "calc", "arguments": {"expr": "1+', TOOLS)
    assert out.tool_calls == []
    assert any("unclosed" in e for e in out.errors)
    # The fragment stays visible, without the marker (the call's record keeps the raw text).
    assert out.content == 'Thinking {"name": "calc", "arguments": {"expr": "1+'


def test_unknown_tool_is_an_error_but_still_returned(parser):
    out = parser.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS)
    assert [c.name for c in out.tool_calls] == ["rm_rf"]
    assert len(out.errors) == 1 and "unknown tool 'rm_rf'" in out.errors[0]
    # Without a name list, names are not checked.
    assert parser.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None).errors == []


def test_no_tools_offered(parser):
    out = parser.parse('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', set())
    assert out.errors and "no tools were offered" in out.errors[0]


def test_arguments_as_json_string_accepted(parser):
    out = parser.parse('<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"2*3\\"}"}</tool_call>', TOOLS)
    assert out.errors == []
    assert out.tool_calls[0].arguments == {"expr": "2*3"}


def test_missing_arguments_means_empty(parser):
    out = parser.parse('<tool_call>{"name": "search"}</tool_call>', TOOLS)
    assert out.errors == [] and out.tool_calls[0].arguments == {}


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"arguments": {}}', "name"),
        ('{"name": 3, "arguments": {}}', "name"),
        ('{"name": "calc", "arguments": [1, 2]}', "JSON object"),
        ('{"name": "calc", "arguments": "not json"}', "not valid JSON"),
        ('{"name": "calc", "arguments": "[1]"}', "JSON object"),
        ('["calc"]', "JSON object"),
    ],
)
def test_malformed_calls(parser, body, message):
    out = parser.parse(f"<tool_call>{body}</tool_call>", TOOLS)
    assert out.tool_calls == []
    assert len(out.errors) == 1 and message in out.errors[0]


def test_one_bad_call_does_not_drop_the_good_one(parser):
    text = '<tool_call>{"name": "calc", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    out = parser.parse(text, TOOLS)
    assert [c.name for c in out.tool_calls] == ["calc"]
    assert len(out.errors) == 1


Q = '<|"|>'


def test_gemma4_quotes_after_whitespace_are_quotes():
    out = Gemma4ToolParser().parse(f"<|tool_call>call:lookup{{name: {Q}Ada{Q}}}<tool_call|>", {"lookup"})
    assert out.errors == [] and out.tool_calls[0].arguments == {"name": "Ada"}
    # Whitespace wherever it may stand: around keys, values, ':' and ',', inside lists and nested maps.
    text = (f"<|tool_call> call : lookup {{ \n name : {Q}Ada, Countess{Q} ,\n\ttags : [ {Q}a{Q} , 2 ] ,"
            f" opts : {{ deep : None , {Q}quoted key{Q} : true }} \n}} <tool_call|>")
    out = Gemma4ToolParser().parse(text, {"lookup"})
    assert out.errors == []
    assert out.tool_calls[0].arguments == {"name": "Ada, Countess", "tags": ["a", 2],
                                           "opts": {"deep": None, "quoted key": True}}


def test_gemma4_a_quote_marker_inside_an_unquoted_value_is_an_error():
    out = Gemma4ToolParser().parse(f"<|tool_call>call:lookup{{name:Ada{Q}Lovelace{Q}}}<tool_call|>", {"lookup"})
    assert out.tool_calls == [] and "marker" in out.errors[0]


# A call of each family whose arguments hold `nested` (brackets the family's decoder has to descend into).
DEEP_CALL = {
    "hermes": lambda nested: f'<tool_call>{{"name": "f", "arguments": {{"x": {nested}}}}}</tool_call>',
    "qwen3_coder": lambda nested: f"<tool_call><function=f><parameter=x>{nested}</parameter></function></tool_call>",
    "llama3_json": lambda nested: f'<|python_tag|>{{"name": "f", "parameters": {{"x": {nested}}}}}',
    "mistral": lambda nested: f'[TOOL_CALLS][{{"name": "f", "arguments": {{"x": {nested}}}}}]',
    "gemma4": lambda nested: f"<|tool_call>call:f{{x:{nested}}}<tool_call|>",
}


def test_every_parser_has_a_deep_call():
    assert set(DEEP_CALL) == set(TOOL_PARSERS)


@pytest.mark.parametrize("name", sorted(DEEP_CALL))
@pytest.mark.parametrize("nested", ["[" * 5000 + "]" * 5000, "[" * 5000, '{"a":' * 5000, "[" * (MAX_NESTING + 1) +
                                    "]" * (MAX_NESTING + 1)], ids=["balanced", "open", "braces", "just-too-deep"])
def test_5000_deep_brackets_are_a_parse_failure_not_an_exception(name, nested):
    out = TOOL_PARSERS[name]().parse(DEEP_CALL[name](nested), {"f"})
    assert out.tool_calls == [] and out.errors, out


@pytest.mark.parametrize("name", sorted(DEEP_CALL))
def test_nesting_within_the_bound_is_read(name):
    depth = MAX_NESTING - 2  # the call's own map and the argument's level count too
    out = TOOL_PARSERS[name]().parse(DEEP_CALL[name]("[" * depth + "]" * depth), {"f"})
    assert out.errors == [] and len(out.tool_calls) == 1


# NaN and Infinity are not JSON: where a value is JSON-or-text (Qwen3-Coder, Gemma 4) they stay the model's text.
JSON_VALUE_PARSERS = ["hermes", "llama3_json", "mistral"]


@pytest.mark.parametrize("name", sorted(DEEP_CALL))
@pytest.mark.parametrize("number", ["1e999", "-1e999", "[1, 2e400]"])
def test_a_number_beyond_the_float_range_is_a_parse_failure_in_every_family(name, number):
    out = TOOL_PARSERS[name]().parse(DEEP_CALL[name](number), {"f"})
    assert out.tool_calls == [] and "beyond the float range" in out.errors[0], out


@pytest.mark.parametrize("name", JSON_VALUE_PARSERS)
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "[1, NaN]"])
def test_nan_and_infinity_in_json_arguments_are_a_parse_failure(name, constant):
    out = TOOL_PARSERS[name]().parse(DEEP_CALL[name](constant), {"f"})
    assert out.tool_calls == [] and "NaN and Infinity are not JSON" in out.errors[0], out


@pytest.mark.parametrize("name", sorted(set(DEEP_CALL) - set(JSON_VALUE_PARSERS)))
def test_nan_where_a_value_may_be_text_stays_the_text_never_a_float(name):
    out = TOOL_PARSERS[name]().parse(DEEP_CALL[name]("NaN"), {"f"})
    assert out.errors == [] and out.tool_calls[0].arguments == {"x": "NaN"}
    json.dumps(out.tool_calls[0].arguments, allow_nan=False)


@pytest.mark.parametrize("parser, text, content", [
    (HermesToolParser(), "Done.</tool_call>", "Done."),
    (HermesToolParser(), 'A <tool_call>{"name": "f", "arguments": {"x": "<tool_call>"}}</tool_call>', "A"),
    (Llama3JsonToolParser(), 'Sure. <|python_tag|>{"name": "f", "parameters": {}}',
     'Sure. {"name": "f", "parameters": {}}'),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "f", "arguments": {"x": "[TOOL_CALLS]"}}]', ""),
    (Gemma4ToolParser(), f"<|tool_call>call:f{{x:{Q}a{Q}}}<tool_call|> then {Q}", "then"),
    (Gemma4ToolParser(), "<|tool_call>call:f{x:<|<|tool_call>tool_call>", "call:f{x:"),
])
def test_markers_never_reach_the_agent_and_the_call_is_flagged(parser, text, content):
    out = parser.parse(text, {"f"})
    assert out.errors and out.content == content
    assert not any(m in (c.name + repr(c.arguments)) for c in out.tool_calls for m in parser.markers)


def test_mistral_text_after_the_calls_is_content_and_a_second_marker_more_calls():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}] and [TOOL_CALLS][{"name": "g", "arguments": {}}] done'
    out = MistralToolParser().parse(text, {"f", "g"})
    assert out.errors == [] and [c.name for c in out.tool_calls] == ["f", "g"] and out.content == "and  done"


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (ThinkReasoningParser(), "<think>a</think>b</think>c", "a", "bc"),
    (ThinkReasoningParser(), "Hi <think>plan, then cut", "plan, then cut", "Hi "),
    (ThinkReasoningParser(), "<think>a</think>b<think>c</think>d", "a\nc", "bd"),
    (ThinkReasoningParser(), "a<think>b</think>", "b", "a"),
    (ChannelReasoningParser(), "<|channel>thought\nplan<channel|>answer<channel|>", "plan", "answer"),
])
def test_reasoning_markers_never_reach_the_agent(parser, text, reasoning, content):
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("raw, value", [("0\x0c", "0\x0c"), ("\x1c7", "\x1c7"), (" 7\t", 7), ("\n[1]\r\n", [1])])
def test_only_json_whitespace_is_trimmed_before_a_value_is_read_as_json(raw, value):
    # str.strip() also trims form feeds and other Unicode spaces: "0\x0c" came back as the number 0 (fuzzed).
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    out = TOOL_PARSERS["qwen3_coder"]().parse(text, {"f"})
    assert out.errors == [] and [(c.name, c.arguments) for c in out.tool_calls] == [("f", {"x": value})]


def test_qwen3_coder_reads_a_parameter_by_its_declared_type():
    """Qwen3-Coder writes every value as bare text: a string parameter holding digits (a badge "6282")
    stays the string the schema declares, as vLLM's parser reads it; other types, or no schema, read as JSON."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "badge": {"type": "string"}, "count": {"type": "integer"}, "either": {"type": ["string", "null"]}}}}}]
    text = ("<tool_call><function=f><parameter=badge>\n6282\n</parameter><parameter=count>\n7\n</parameter>"
            "<parameter=either>\n12\n</parameter></function></tool_call>")
    parser = TOOL_PARSERS["qwen3_coder"]()
    assert parser.parse(text, {"f"}, tools=tools).tool_calls[0].arguments == {"badge": "6282", "count": 7, "either": 12}
    assert parser.parse(text, {"f"}).tool_calls[0].arguments == {"badge": 6282, "count": 7, "either": 12}
