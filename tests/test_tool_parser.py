"""Hermes tool-call parsing: well-formed calls, and every malformation reported as an error."""

from __future__ import annotations

import pytest

from astuner.model_tuner.tool_parser import TOOL_PARSERS, HermesToolParser, get_tool_parser

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
    assert out.content.startswith("Thinking <tool_call>")  # the fragment stays visible


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
