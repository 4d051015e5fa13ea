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
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_NESTING = 100


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


_TOO_DEEP = "nested too deeply"
_NOT_JSON_NUMBER = "NaN and Infinity are not JSON"
_OVERFLOW = "a number beyond the float range"


def _no_constant(name: str) -> Any:
    raise ValueError(_NOT_JSON_NUMBER)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON, but no tool can receive it, nor a client decode it
        raise ValueError(_OVERFLOW)
    return value


# Strict JSON: Python's decoder would take NaN/Infinity and turn 1e999 into inf, which no JSON encoder downstream
# (the gateway's responses, Starlette's allow_nan=False) can write back.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def _raw_decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """`JSONDecoder.raw_decode` of strict JSON (every number finite) whose every failure is a JSONDecodeError:
    Python's decoder recurses (RecursionError on deep nesting) and refuses integers of more than 4,300 digits
    (ValueError)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError(_TOO_DEEP, text, pos) from None
    except ValueError as exc:
        raise json.JSONDecodeError(str(exc), text, pos) from None


JSON_WHITESPACE = " \t\n\r"


def _loads(text: str) -> Any:
    """json.loads with the failures of `_raw_decode`. Only JSON's whitespace is trimmed: a 0 followed by a form
    feed is not JSON (str.strip would make it 0), and stays the text the model wrote."""
    stripped = text.strip(JSON_WHITESPACE)
    value, end = _raw_decode(stripped)
    if end != len(stripped):
        raise json.JSONDecodeError("Extra data", stripped, end)
    return value


def _marker_pattern(markers: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))


def _remove_markers(text: str, pattern: re.Pattern) -> str:
    """The text without any marker; repeated, since removing one can join the pieces of another."""
    while pattern.search(text):
        text = pattern.sub("", text)
    return text


def without_markers(text: str, markers: tuple[str, ...]) -> str:
    """`text` with every one of `markers` removed (what an agent may see of output that was not parsed as calls)."""
    return _remove_markers(text, _marker_pattern(markers)) if markers else text


def _argument_problem(call: ParsedToolCall, markers: tuple[str, ...]) -> str | None:
    """Why the call cannot reach the agent (a marker in its name or arguments, too deep a nesting), or None.
    Iterative: the arguments may be as deep as the decoder allows."""
    stack: list[tuple[Any, int]] = [(call.arguments, 1)]
    strings = [call.name]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            return f"arguments nested deeper than {MAX_NESTING} levels"
        if isinstance(value, dict):
            strings.extend(k for k in value if isinstance(k, str))
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            strings.append(value)
    found = [m for m in markers if any(m in s for s in strings)]
    return f"the call holds the format's marker {found[0]!r} (a malformed call)" if found else None


def _checked_call(call: ParsedToolCall, where: str, tool_names: set[str] | None):
    """(call, error): the call is returned even when its name is unknown, because the agent framework answers
    it with a "not found" tool message, which is useful feedback for the model."""
    if tool_names is not None:
        if not tool_names:
            return call, f"{where}: called {call.name!r} but no tools were offered"
        if call.name not in tool_names:
            return call, f"{where}: unknown tool {call.name!r} (offered: {', '.join(sorted(tool_names))})"
    return call, None


def _add_call(out: ParsedOutput, call: ParsedToolCall, where: str, tool_names: set[str] | None,
              markers: tuple[str, ...]) -> None:
    """Append the call to `out` with the name check's error when it has one (_checked_call); a call that holds
    a marker or nests too deeply is only an error."""
    problem = _argument_problem(call, markers)
    if problem:
        out.errors.append(f"{where} ({call.name[:40]!r}): {problem}")
        return
    call, err = _checked_call(call, where, tool_names)
    if err:
        out.errors.append(err)
    out.tool_calls.append(call)


def _finish(out: ParsedOutput, markers: tuple[str, ...]) -> ParsedOutput:
    """Remove what is left of the format's markers from the content, reporting those that were stray."""
    found = [m for m in markers if m in out.content]
    if found:
        out.content = _remove_markers(out.content, _marker_pattern(markers)).strip()
        out.errors.append(f"{', '.join(found)} outside a tool call (removed from the content)")
    return out


def _arguments_object(arguments: Any, where: str, name: str) -> tuple[dict | None, str | None]:
    """Arguments as a dict; a JSON string holding an object is accepted (some models double-encode them, as the
    OpenAI API does)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f"{where} ({name}): 'arguments' is a string that is not valid JSON"
    if not isinstance(arguments, dict):
        return None, f"{where} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}"
    return arguments, None


def _blocks_output(text: str, block: re.Pattern, open_tag: str,
                   markers: tuple[str, ...]) -> tuple[ParsedOutput, list[str]]:
    """(the output holding the text outside the blocks and an unclosed-tag error, if any; the block bodies)."""
    outside, bodies, pos = [], [], 0
    for match in block.finditer(text):
        outside.append(text[pos : match.start()])
        bodies.append(match.group(1))
        pos = match.end()
    tail = text[pos:]
    errors = []
    cut = tail.find(open_tag)
    if cut >= 0:
        # Usually generation hit max_tokens mid-call; the fragment stays visible as plain text, without markers.
        errors.append(f"unclosed {open_tag} at the end of the output")
        tail = tail[:cut] + _remove_markers(tail[cut:], _marker_pattern(markers))
    outside.append(tail)
    return ParsedOutput(content="".join(outside).strip(), errors=errors), bodies


class _TaggedBlocks:
    """A family whose calls stand between an open and a close tag: the block pattern, the markers and the
    split of the text into content and call bodies, shared."""

    open_tag: str
    close_tag: str
    markers: tuple[str, ...]
    _block: re.Pattern

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._block = re.compile(re.escape(cls.open_tag) + r"(.*?)" + re.escape(cls.close_tag), re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return any(m in text for m in self.markers)

    def _split(self, text: str) -> tuple[ParsedOutput, list[str]]:
        return _blocks_output(text, self._block, self.open_tag, self.markers)


class HermesToolParser(_TaggedBlocks):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as in Hermes / Qwen models."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out, bodies = self._split(text)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            try:
                obj = _loads(body)
            except json.JSONDecodeError as exc:
                out.errors.append(f"{where}: invalid JSON ({exc.msg})")
                continue
            if not isinstance(obj, dict):
                out.errors.append(f"{where}: expected a JSON object, got {type(obj).__name__}")
                continue
            name = obj.get("name")
            if not isinstance(name, str) or not name:
                out.errors.append(f"{where}: missing or non-string 'name'")
                continue
            arguments, err = _arguments_object(obj.get("arguments"), where, name)
            if err:
                out.errors.append(err)
                continue
            _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", name, arguments), where, tool_names,
                      self.markers)
        return _finish(out, self.markers)


class Qwen3CoderToolParser(_TaggedBlocks):
    """Qwen3-Coder's XML calls: <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>.

    Parameter values are raw text: a value that parses as JSON (number, object, list, true/false/null) becomes
    that value, anything else stays a string (what Qwen3-Coder's template writes for a string argument)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return super().has_tool_call(text) or "<function=" in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out, bodies = self._split(text)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            match = self._function.match(body)
            if match is None:
                out.errors.append(f"{where}: expected <function=NAME>...</function> inside <tool_call>")
                continue
            name, inner = match.group(1).strip(), match.group(2)
            try:
                arguments = {p.group(1).strip(): _json_or_text(p.group(2)) for p in self._parameter.finditer(inner)}
            except ValueError as exc:
                out.errors.append(f"{where} ({name}): {exc}")
                continue
            leftover = self._parameter.sub("", inner).strip()
            if leftover:
                out.errors.append(f"{where} ({name}): text outside <parameter=...> tags: {leftover[:40]!r}")
                continue
            _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", name, arguments), where, tool_names,
                      self.markers)
        return _finish(out, self.markers)


def _json_or_text(raw: str) -> Any:
    """The value's JSON value, else its text (NaN and Infinity are not JSON: they stay the text the model wrote).
    ValueError when it is JSON that cannot be used: too deep to decode, or a number beyond the float range (left
    as text either would pass for a string)."""
    try:
        return _loads(raw)
    except json.JSONDecodeError as exc:
        if exc.msg == _TOO_DEEP:
            raise ValueError("a value nested deeper than JSON decoding allows") from None
        if exc.msg == _OVERFLOW:
            raise ValueError(f"{_OVERFLOW} (not finite): {raw.strip()[:40]!r}") from None
        return raw


class Llama3JsonToolParser:
    """Llama 3.x JSON calls: the whole answer is {"name": ..., "parameters": {...}} (or "arguments"), optionally
    after <|python_tag|>; several calls are joined by ";". Text that is not such an object is plain content."""

    python_tag = "<|python_tag|>"
    markers = (python_tag,)

    def has_tool_call(self, text: str) -> bool:
        stripped = text.strip()
        return self.python_tag in stripped or (stripped.startswith("{") and '"name"' in stripped)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        stripped = text.strip()
        if not (stripped.startswith(self.python_tag) or (stripped.startswith("{") and '"name"' in stripped)):
            return _finish(ParsedOutput(content=stripped), self.markers)
        body = stripped.removeprefix(self.python_tag).strip()
        out = ParsedOutput(content="")
        if not body:
            out.errors.append(f"no call after {self.python_tag}")
        pos, index = 0, 0
        while pos < len(body):
            try:
                obj, end = _raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                out.errors.append(f"tool call {index}: invalid JSON ({exc.msg})")
                out.content = body[pos:].strip()
                return _finish(out, self.markers)
            where = f"tool call {index}"
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                out.errors.append(f"{where}: expected an object with a string 'name'")
            else:
                args = obj.get("parameters", obj.get("arguments"))
                arguments, err = _arguments_object(args, where, obj["name"])
                if err:
                    out.errors.append(err)
                else:
                    _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", obj["name"], arguments), where,
                              tool_names, self.markers)
            index += 1
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return _finish(out, self.markers)


class MistralToolParser:
    """Mistral's [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}] (a JSON list after the marker).

    Mistral's templates require call ids of exactly 9 alphanumeric characters; an id the model wrote is kept
    when it has that shape, otherwise one is derived from the call's position (stable, so prompts repeat).
    Text after a list is content; a second marker starts another list."""

    marker = "[TOOL_CALLS]"
    markers = (marker,)

    def has_tool_call(self, text: str) -> bool:
        return self.marker in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        head, *segments = text.split(self.marker)
        out = ParsedOutput(content="")
        content, index = [head], 0
        for segment in segments:
            body = segment.lstrip()
            try:
                obj, end = _raw_decode(body)
            except json.JSONDecodeError as exc:
                out.errors.append(f"tool calls: invalid JSON after {self.marker} ({exc.msg})")
                continue
            content.append(body[end:])
            items = [obj] if isinstance(obj, dict) else obj
            if not isinstance(items, list):
                out.errors.append(f"tool calls: expected a JSON list after {self.marker}")
                continue
            for item in items:
                self._add(out, item, f"tool call {index}", index, tool_names, id_prefix)
                index += 1
        out.content = "".join(content).strip()
        return _finish(out, self.markers)

    def _add(self, out: ParsedOutput, item: Any, where: str, index: int, tool_names: set[str] | None,
             id_prefix: str) -> None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            out.errors.append(f"{where}: expected an object with a string 'name'")
            return
        arguments, err = _arguments_object(item.get("arguments"), where, item["name"])
        if err:
            out.errors.append(err)
            return
        given = item.get("id")
        call_id = given if isinstance(given, str) and re.fullmatch(r"[A-Za-z0-9]{9}", given) else (
            mistral_call_id(f"{id_prefix}_{index}"))
        _add_call(out, ParsedToolCall(call_id, item["name"], arguments), where, tool_names, self.markers)


class Gemma4ToolParser(_TaggedBlocks):
    """Gemma 4's calls, as its template writes them: `<|tool_call>call:NAME{key:value,...}<tool_call|>`.

    The template (`format_argument`) writes a string between `<|"|>` quotes, a map as `{key:value,...}` with
    bare keys, a list as `[a,b]`, booleans as true/false, numbers as Python prints them and None as `None`, with
    no spaces. Models add spaces and newlines anyway, so whitespace may stand around every key, value, `:` and
    `,`. Keys may also be `<|"|>`-quoted; an unquoted value is a number, true/false/null/None or, failing that,
    its text."""

    open_tag, close_tag, quote = "<|tool_call>", "<tool_call|>", '<|"|>'
    markers = (open_tag, close_tag, quote)
    _call = re.compile(r"\s*call\s*:\s*([^{\s]+)\s*(\{.*\})\s*$", re.DOTALL)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call") -> ParsedOutput:
        out, bodies = self._split(text)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            match = self._call.match(body)
            if match is None:
                out.errors.append(f"{where}: expected call:NAME{{...}} inside {self.open_tag}")
                continue
            name = match.group(1)
            try:
                arguments = _GemmaReader(match.group(2)).read()
            except ValueError as exc:
                out.errors.append(f"{where} ({name}): {exc}")
                continue
            _add_call(out, ParsedToolCall(f"{id_prefix}_{index}", name, arguments), where, tool_names,
                      self.markers)
        return _finish(out, self.markers)


_GEMMA_BARE = {"true": True, "false": False, "null": None, "None": None}


class _GemmaReader:
    """Reads one Gemma 4 argument map; every failure is a ValueError. Recursion is bounded by MAX_NESTING."""

    quote = Gemma4ToolParser.quote
    _bare = re.compile(r"[^,}\]]*")
    _key = re.compile(r"[^:,{}\[\]]*")

    def __init__(self, s: str) -> None:
        self.s, self.i = s, 0

    def read(self) -> dict:
        value = self._value(0)
        self._space()
        if self.i != len(self.s):
            raise ValueError(f"unexpected text after the arguments: {self.s[self.i:][:40]!r}")
        return value

    def _space(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._space()
        if self.i >= len(self.s):
            raise ValueError("the arguments end too early")
        return self.s[self.i]

    def _string(self) -> str:
        start = self.i + len(self.quote)
        end = self.s.find(self.quote, start)
        if end < 0:
            raise ValueError(f"unclosed {self.quote} string")
        self.i = end + len(self.quote)
        return self.s[start:end]

    def _value(self, depth: int) -> Any:
        if depth >= MAX_NESTING:
            raise ValueError(f"arguments nested deeper than {MAX_NESTING} levels")
        head = self._peek()
        if self.s.startswith(self.quote, self.i):
            return self._string()
        if head == "{":
            return self._map(depth)
        if head == "[":
            return self._list(depth)
        raw = self._bare.match(self.s, self.i).group(0)
        self.i += len(raw)
        raw = raw.strip()
        if not raw:
            raise ValueError(f"a missing value at {self.s[self.i:][:20]!r}")
        if raw in _GEMMA_BARE:
            return _GEMMA_BARE[raw]
        return _json_or_text(raw)

    def _map(self, depth: int) -> dict:
        out: dict = {}
        self.i += 1
        while self._peek() != "}":
            if self.s.startswith(self.quote, self.i):
                key = self._string()
            else:
                key = self._key.match(self.s, self.i).group(0)
                self.i += len(key)
                key = key.strip()
                if not key:
                    raise ValueError(f"a missing key at {self.s[self.i:][:20]!r}")
            if self._peek() != ":":
                raise ValueError(f"expected ':' after key {key!r}")
            self.i += 1
            out[key] = self._value(depth + 1)
            if self._peek() == ",":
                self.i += 1
            elif self._peek() != "}":
                raise ValueError(f"expected ',' or '}}' after {key!r}")
        self.i += 1
        return out

    def _list(self, depth: int) -> list:
        items = []
        self.i += 1
        while self._peek() != "]":
            items.append(self._value(depth + 1))
            if self._peek() == ",":
                self.i += 1
            elif self._peek() != "]":
                raise ValueError("expected ',' or ']' in a list")
        self.i += 1
        return items


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
