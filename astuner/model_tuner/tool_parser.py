"""Parsing tool calls out of generated text, one parser per model family.

Parsers live in an explicit registry (`TOOL_PARSERS`), named by `rollout.tool_parser` (or detected from the chat
template, see `formats.py`). A parser never raises on bad model output: what it cannot use becomes an entry of
`ParsedOutput.errors`, which the `wrong_toolcall` madness check turns into a flag and the rollout counts in
`rollout/tool_call_parse_failure_rate`, so a malformed call costs reward instead of crashing the episode.

Formats (what the model writes; each is what the family's own chat template renders for a past tool call):
  hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>       Hermes, Qwen2.5, Qwen3
  qwen3_coder   <tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>
  llama3_json   {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, several joined by ";"
  mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcdefghi"}, ...]
  gemma4        <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|> quotes      Gemma 4

Each parser names its `markers`: the strings it reads. Where a family's tokenizer makes them special tokens
(`<|python_tag|>`, `[TOOL_CALLS]`), the response is decoded with them kept (decoding.py).

Markers never reach the agent: a call whose name or arguments hold one is an error (not returned), and a marker
left in the content (a stray one, or the open tag of a call cut at max_tokens, whose fragment stays visible as
plain text) is removed from it and reported. The call's record keeps the raw text. Arguments nested deeper than
`MAX_NESTING` levels are an error too: no tool means them, and JSON encoders downstream recurse. JSON is read
strictly: NaN, Infinity and a number beyond the float range (1e999) are an error, so every returned call's
arguments are strict JSON (`json.dumps(..., allow_nan=False)` holds) on every route of the gateway.

This module holds the registry; the parsers are in `tool_parser_families.py`, the records, strict JSON and the
checks they share in `tool_parser_base.py`.
"""

from __future__ import annotations

from astuner.model_tuner.tool_parser_base import (
    JSON_WHITESPACE,
    MAX_NESTING,
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    without_markers,
)
from astuner.model_tuner.tool_parser_families import (
    Gemma4ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    mistral_call_id,
)

__all__ = [
    "JSON_WHITESPACE",
    "MAX_NESTING",
    "TOOL_PARSERS",
    "Gemma4ToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedOutput",
    "ParsedToolCall",
    "Qwen3CoderToolParser",
    "ToolParser",
    "get_tool_parser",
    "mistral_call_id",
    "without_markers",
]

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "gemma4": Gemma4ToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """An instance of the parser registered under `name`."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}") from None
