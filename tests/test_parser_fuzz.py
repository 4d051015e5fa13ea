"""Every tool parser and every reasoning parser, fuzzed: text built from the families' own markers, brackets,
quotes, whitespace and deep nesting never makes a parser raise, always yields the declared types, and never lets a
marker reach what the agent sees; a call rendered by the family's own chat template round-trips."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astuner.model_tuner import ChatRenderer
from astuner.model_tuner.formats import REASONING_PARSERS, ReasoningSplit
from astuner.model_tuner.pipeline_check import assistant_turn_text
from astuner.model_tuner.tool_parser import TOOL_PARSERS, ParsedOutput, ParsedToolCall

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_MARKERS = sorted({m for p in (*TOOL_PARSERS.values(), *REASONING_PARSERS.values()) for m in p.markers})
PIECES = [*ALL_MARKERS, "{", "}", "[", "]", '"', "'", ":", ",", ";", " ", "\n", "\t", "call:", "call:f", '"name"',
          '"arguments"', '"parameters"', '"f"', "<function=f>", "</function>", "<parameter=x>", "</parameter>",
          "thought\n", "1", "-2.5e3", "true", "None", "null", "x", "é", "\\"]
# Well-formed calls of each family, which the fuzzer splices with pieces to reach the parsers' deeper paths.
SEEDS = ['<tool_call>{"name": "f", "arguments": {"x": [1, {"y": "z"}]}}</tool_call>',
         "<tool_call>\n<function=f>\n<parameter=x>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
         '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "f", "parameters": {}}',
         '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "abcdefghi"}]',
         '<|tool_call>call:f{x:<|"|>a, b<|"|>,y:[1,{z:true}]}<tool_call|>',
         "<think>plan</think>answer", "<|channel>thought\nplan<channel|>answer"]
SLOTTED = [('<tool_call>{"name": "f", "arguments": {"x": ', "}}</tool_call>"),
           ("<tool_call><function=f><parameter=x>", "</parameter></function></tool_call>"),
           ('<|python_tag|>{"name": "f", "parameters": {"x": ', "}}"),
           ('[TOOL_CALLS][{"name": "f", "arguments": {"x": ', "}}]"),
           ("<|tool_call>call:f{x:", "}<tool_call|>")]


# Numbers at the edges of JSON: no encoder downstream may be handed NaN or an infinity.
EDGE_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[1, 1e400]", "1e308", "-0.0", "1" * 60]


@st.composite
def hostile_text(draw) -> str:
    opening = st.sampled_from(["[", "{", '{"a":', "{a:", "[<|\"|>"])
    deep = st.tuples(opening, st.integers(0, 5000)).map(lambda t: t[0] * t[1])
    piece = st.one_of(st.sampled_from(PIECES), st.text(max_size=4), deep)
    parts = draw(st.lists(piece, max_size=24))
    if draw(st.booleans()):  # in the value slot of a call, so that deep nesting reaches the decoders
        head, tail = draw(st.sampled_from(SLOTTED))
        if draw(st.booleans()):
            return head + draw(st.sampled_from(EDGE_NUMBERS)) + tail
        nested = draw(opening) * draw(st.sampled_from([101, 1200, 5000]))
        return head + nested + "".join(parts) + tail
    seed = draw(st.sampled_from(["", *SEEDS]))
    at = draw(st.integers(0, len(seed)))
    return seed[:at] + "".join(parts) + seed[at:]


def _strings(value) -> list[str]:
    """Every string in a JSON-like value, keys included (iterative: the value may be deep)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend([*v.keys(), *v.values()])
        elif isinstance(v, list):
            stack.extend(v)
    return out


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@FUZZ
@given(text=hostile_text(), tool_names=st.sampled_from([None, set(), {"f"}]))
def test_a_tool_parser_never_raises_and_no_marker_reaches_the_agent(name, text, tool_names):
    parser = TOOL_PARSERS[name]()
    out = parser.parse(text, tool_names)
    assert isinstance(out, ParsedOutput) and isinstance(out.content, str)
    assert all(isinstance(e, str) for e in out.errors)
    assert isinstance(parser.has_tool_call(text), bool)
    for call in out.tool_calls:
        assert isinstance(call, ParsedToolCall) and isinstance(call.id, str) and isinstance(call.name, str)
        assert isinstance(call.arguments, dict)
        json.dumps(call.arguments, allow_nan=False)  # what the gateway does with them next (strict JSON)
    seen = [out.content, *(s for c in out.tool_calls for s in [c.name, *_strings(c.arguments)])]
    leaked = [m for m in parser.markers if any(m in s for s in seen)]
    assert not leaked, (leaked, out)
    if any(m in text for m in parser.markers) and not out.tool_calls:
        assert out.errors, "markers that made no call must be flagged"


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@FUZZ
@given(text=hostile_text())
def test_a_reasoning_parser_never_raises_and_no_marker_reaches_the_agent(name, text):
    parser = REASONING_PARSERS[name]()
    split = parser.split(text)
    assert isinstance(split, ReasoningSplit) and isinstance(split.content, str)
    assert split.reasoning is None or isinstance(split.reasoning, str)
    leaked = [m for m in parser.markers if m in split.content or m in (split.reasoning or "")]
    assert not leaked, (leaked, split)


# family -> (template file in the llama.cpp sdist, tool parser, reasoning parser, end-of-turn texts)
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", "none", ("<|im_end|>",)),
    "qwen3_coder": ("Qwen3-Coder.jinja", "qwen3_coder", "none", ("<|im_end|>",)),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", "none", ("<|eot_id|>", "<|eom_id|>")),
    "mistral_nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", "none", ("</s>",)),
    "gemma4": ("google-gemma-4-31B-it.jinja", "gemma4", "channel", ("<|tool_response>", "<turn|>")),
}


@pytest.fixture(scope="module")
def renderers(demo_tokenizer, llama_cpp_models):
    """The demo vocabulary with each family's real chat template."""
    out = {}
    for family, (template, *_) in FAMILIES.items():
        tok = copy.copy(demo_tokenizer)  # the template is the tokenizer's own attribute; the vocabulary is shared
        tok.chat_template = (llama_cpp_models / template).read_text()
        out[family] = ChatRenderer(tok, "template")
    return out


def _text(markers: tuple[str, ...]):
    return st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12).filter(
        lambda s: not any(m in s for m in markers))


def _arguments(family: str, markers: tuple[str, ...]):
    """Arguments the family's template writes unambiguously. Qwen3-Coder writes a top-level value as its raw
    text (a boolean as `True`, a string that looks like JSON as that JSON), so its top level is text that is not
    JSON, or an integer, list or map; deeper values are JSON there."""
    key = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False, width=32), _text(markers))
    value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(key, inner, max_size=3),
                         max_leaves=8)
    if family == "qwen3_coder":
        def plain(s: str) -> bool:
            try:
                json.loads(s)
                return False
            except ValueError:
                return s == s.strip("\n") and "</parameter>" not in s and "<parameter=" not in s

        top = st.one_of(_text(markers).filter(plain), st.integers(-10**6, 10**6),
                        st.lists(value, max_size=3), st.dictionaries(key, value, max_size=3))
        return st.dictionaries(key, top, max_size=4)
    return st.dictionaries(key, value, max_size=4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_call_the_familys_template_renders_round_trips(family, renderers, data):
    _, tool, reasoning, stops = FAMILIES[family]
    tool_parser, reasoning_parser = TOOL_PARSERS[tool](), REASONING_PARSERS[reasoning]()
    arguments = data.draw(_arguments(family, tool_parser.markers), label="arguments")
    messages = [{"role": "user", "content": "Go."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "abcDEF123", "type": "function",
                     "function": {"name": "lookup", "arguments": json.dumps(arguments)}}]}]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    text = assistant_turn_text(renderers[family], messages, 1, tools, stops)
    out = tool_parser.parse(reasoning_parser.split(text).content, {"lookup"})
    assert out.errors == [], text
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("lookup", arguments)], text
