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
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolParser(Protocol):
    markers: tuple[str, ...]

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        """Split `text` into plain content and tool calls.

        tool_names: the names offered in this call; None skips the name check, an empty set means no tools were
        offered (so any call is an error). id_prefix: call ids are f"{id_prefix}_{index}".
        """

    def has_tool_call(self, text: str) -> bool:
        """Whether the text contains anything this parser would treat as a tool call attempt."""


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as in Hermes / Qwen models."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return self.open_tag in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out = ParsedOutput(content="")
        outside: list[str] = []
        pos = 0
        index = 0
        for match in self._block.finditer(text):
            outside.append(text[pos : match.start()])
            pos = match.end()
            call, error = self._parse_block(match.group(1), index, tool_names, id_prefix)
            index += 1
            if error:
                out.errors.append(error)
            if call is not None:
                out.tool_calls.append(call)
        tail = text[pos:]
        if self.open_tag in tail:
            # Usually generation hit max_tokens mid-call; the fragment stays visible as plain text.
            out.errors.append(f"unclosed {self.open_tag} at the end of the output")
        outside.append(tail)
        out.content = "".join(outside).strip()
        return out

    def _parse_block(
        self, body: str, index: int, tool_names: set[str] | None, id_prefix: str
    ) -> tuple[ParsedToolCall | None, str | None]:
        where = f"tool call {index}"
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return None, f"{where}: invalid JSON ({exc.msg})"
        if not isinstance(obj, dict):
            return None, f"{where}: expected a JSON object, got {type(obj).__name__}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None, f"{where}: missing or non-string 'name'"
        arguments = obj.get("arguments", {})
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            # Some models double-encode the arguments, as the OpenAI API does; accept it when it holds an object.
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None, f"{where} ({name}): 'arguments' is a string that is not valid JSON"
        if not isinstance(arguments, dict):
            return None, f"{where} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}"
        return _checked_call(ParsedToolCall(id=f"{id_prefix}_{index}", name=name, arguments=arguments),
                             where, tool_names)


def _checked_call(call: ParsedToolCall, where: str, tool_names: set[str] | None):
    """(call, error): the call is returned even when its name is unknown, because the agent framework answers
    it with a "not found" tool message, which is useful feedback for the model."""
    if tool_names is not None:
        if not tool_names:
            return call, f"{where}: called {call.name!r} but no tools were offered"
        if call.name not in tool_names:
            return call, f"{where}: unknown tool {call.name!r} (offered: {', '.join(sorted(tool_names))})"
    return call, None


def _add_call(out: ParsedOutput, call: ParsedToolCall, where: str, tool_names: set[str] | None) -> None:
    """Append the call to `out`, and the name check's error when it has one (_checked_call)."""
    call, err = _checked_call(call, where, tool_names)
    if err:
        out.errors.append(err)
    out.tool_calls.append(call)


def _arguments_object(arguments: Any, where: str, name: str) -> tuple[dict | None, str | None]:
    """Arguments as a dict; a JSON string holding an object is accepted (some models double-encode them)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f"{where} ({name}): arguments are a string that is not valid JSON"
    if not isinstance(arguments, dict):
        return None, f"{where} ({name}): arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments, None


def _split_blocks(text: str, block: re.Pattern, open_tag: str):
    """(text outside the blocks, [block bodies], error for an unclosed trailing open tag or None)."""
    outside, bodies, pos = [], [], 0
    for match in block.finditer(text):
        outside.append(text[pos : match.start()])
        bodies.append(match.group(1))
        pos = match.end()
    tail = text[pos:]
    error = None
    if open_tag in tail:
        # Usually generation hit max_tokens mid-call; the fragment stays visible as plain text.
        error = f"unclosed {open_tag} at the end of the output"
    outside.append(tail)
    return "".join(outside).strip(), bodies, error


def _blocks_output(text: str, block: re.Pattern, open_tag: str) -> tuple[ParsedOutput, list[str]]:
    """(the output holding the text outside the blocks and an unclosed-tag error, if any; the block bodies)."""
    content, bodies, error = _split_blocks(text, block, open_tag)
    return ParsedOutput(content=content, errors=[error] if error else []), bodies


class Qwen3CoderToolParser:
    """Qwen3-Coder's XML calls: <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>.

    Parameter values are raw text: a value that parses as JSON (number, object, list, true/false/null) becomes
    that value, anything else stays a string (what Qwen3-Coder's template writes for a string argument)."""

    open_tag = "<tool_call>"
    markers = (open_tag, "</tool_call>")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return self.open_tag in text or "<function=" in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out, bodies = _blocks_output(text, self._block, self.open_tag)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            match = self._function.match(body)
            if match is None:
                out.errors.append(f"{where}: expected <function=NAME>...</function> inside <tool_call>")
                continue
            name, inner = match.group(1).strip(), match.group(2)
            arguments = {}
            for param in self._parameter.finditer(inner):
                arguments[param.group(1).strip()] = _xml_value(param.group(2))
            leftover = self._parameter.sub("", inner).strip()
            if leftover:
                out.errors.append(f"{where} ({name}): text outside <parameter=...> tags: {leftover[:40]!r}")
                continue
            _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", name, arguments), where, tool_names)
        return out


def _xml_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class Llama3JsonToolParser:
    """Llama 3.x JSON calls: the whole answer is {"name": ..., "parameters": {...}} (or "arguments"), optionally
    after <|python_tag|>; several calls are joined by ";". Text that is not such an object is plain content."""

    python_tag = "<|python_tag|>"
    markers = (python_tag,)

    def has_tool_call(self, text: str) -> bool:
        stripped = text.strip()
        return stripped.startswith(self.python_tag) or (stripped.startswith("{") and '"name"' in stripped)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        stripped = text.strip()
        if not self.has_tool_call(stripped):
            return ParsedOutput(content=stripped)
        body = stripped.removeprefix(self.python_tag).strip()
        out = ParsedOutput(content="")
        decoder = json.JSONDecoder()
        pos, index = 0, 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                out.errors.append(f"tool call {index}: invalid JSON ({exc.msg})")
                out.content = stripped if not out.tool_calls else body[pos:].strip()
                return out
            where = f"tool call {index}"
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                out.errors.append(f"{where}: expected an object with a string 'name'")
            else:
                args = obj.get("parameters", obj.get("arguments"))
                arguments, err = _arguments_object(args, where, obj["name"])
                if err:
                    out.errors.append(err)
                else:
                    call, err = _checked_call(ParsedToolCall(f"{id_prefix}_{index}", obj["name"], arguments),
                                              where, tool_names)
                    if err:
                        out.errors.append(err)
                    out.tool_calls.append(call)
            index += 1
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return out


class MistralToolParser:
    """Mistral's [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}] (a JSON list after the marker).

    Mistral's templates require call ids of exactly 9 alphanumeric characters; an id the model wrote is kept
    when it has that shape, otherwise one is derived from the call's position (stable, so prompts repeat)."""

    marker = "[TOOL_CALLS]"
    markers = (marker,)

    def has_tool_call(self, text: str) -> bool:
        return self.marker in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        if self.marker not in text:
            return ParsedOutput(content=text.strip())
        head, _, body = text.partition(self.marker)
        out = ParsedOutput(content=head.strip())
        try:
            obj, end = json.JSONDecoder().raw_decode(body.strip())
        except json.JSONDecodeError as exc:
            out.errors.append(f"tool calls: invalid JSON after {self.marker} ({exc.msg})")
            return out
        if isinstance(obj, dict):
            obj = [obj]
        if not isinstance(obj, list):
            out.errors.append(f"tool calls: expected a JSON list after {self.marker}")
            return out
        for index, item in enumerate(obj):
            where = f"tool call {index}"
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                out.errors.append(f"{where}: expected an object with a string 'name'")
                continue
            arguments, err = _arguments_object(item.get("arguments"), where, item["name"])
            if err:
                out.errors.append(err)
                continue
            given = item.get("id")
            call_id = given if isinstance(given, str) and re.fullmatch(r"[A-Za-z0-9]{9}", given) else (
                mistral_call_id(f"{id_prefix}_{index}"))
            call, err = _checked_call(ParsedToolCall(call_id, item["name"], arguments), where, tool_names)
            if err:
                out.errors.append(err)
            out.tool_calls.append(call)
        return out


class Gemma4ToolParser:
    """Gemma 4's calls, as its template writes them: `<|tool_call>call:NAME{key:value,...}<tool_call|>`.

    Values: a string between `<|"|>` quotes, a nested `{key:value}` map, a `[...]` list, or a bare number,
    true/false/null. Keys are bare (or quoted with `<|"|>`)."""

    open_tag, close_tag, quote = "<|tool_call>", "<tool_call|>", '<|"|>'
    markers = (open_tag, close_tag, quote)
    _block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return self.open_tag in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out, bodies = _blocks_output(text, self._block, self.open_tag)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            match = re.match(r"\s*call:([^{\s]+)\s*(\{.*\})\s*$", body, re.DOTALL)
            if match is None:
                out.errors.append(f"{where}: expected call:NAME{{...}} inside {self.open_tag}")
                continue
            name = match.group(1)
            try:
                arguments, end = self._value(match.group(2), 0)
                if end != len(match.group(2)):
                    raise ValueError(f"unexpected text after the arguments: {match.group(2)[end:][:40]!r}")
            except (ValueError, IndexError) as exc:
                out.errors.append(f"{where} ({name}): {exc}")
                continue
            _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", name, arguments), where, tool_names)
        return out

    def _value(self, s: str, i: int) -> tuple[Any, int]:
        if s.startswith(self.quote, i):
            end = s.find(self.quote, i + len(self.quote))
            if end < 0:
                raise ValueError("unclosed <|\"|> string")
            return s[i + len(self.quote):end], end + len(self.quote)
        if s[i] == "{":
            out, i = {}, i + 1
            while s[i] != "}":
                if s.startswith(self.quote, i):
                    key, i = self._value(s, i)
                else:
                    colon = s.find(":", i)
                    if colon < 0:
                        raise ValueError("a key without ':'")
                    key, i = s[i:colon].strip(), colon
                if s[i] != ":":
                    raise ValueError(f"expected ':' after key {key!r}")
                out[key], i = self._value(s, i + 1)
                if s[i] == ",":
                    i += 1
                elif s[i] != "}":
                    raise ValueError(f"expected ',' or '}}' after {key!r}")
            return out, i + 1
        if s[i] == "[":
            items, i = [], i + 1
            while s[i] != "]":
                item, i = self._value(s, i)
                items.append(item)
                if s[i] == ",":
                    i += 1
                elif s[i] != "]":
                    raise ValueError("expected ',' or ']' in a list")
            return items, i + 1
        match = re.compile(r"[^,}\]]*").match(s, i)
        raw = match.group(0).strip()
        try:
            return json.loads(raw), match.end()
        except json.JSONDecodeError:
            return raw, match.end()


def mistral_call_id(seed: str) -> str:
    """A 9-character alphanumeric id derived from `seed` (Mistral templates reject any other shape)."""
    return hashlib.sha1(seed.encode()).hexdigest()[:9]


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
