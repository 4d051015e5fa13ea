"""The per-family tool parsers registered in `tool_parser.py` (`TOOL_PARSERS`); the formats they read are listed
there.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from astuner.model_tuner.tool_parser_base import (
    MAX_NESTING,
    ParsedOutput,
    ParsedToolCall,
    _add_call,
    _arguments_object,
    _finish,
    _json_or_text,
    _loads,
    _raw_decode,
    _TaggedBlocks,
)


class HermesToolParser(_TaggedBlocks):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as in Hermes / Qwen models."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
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

    Parameter values are raw text. A parameter the offered schema declares a string (only) stays the text, as
    vLLM's qwen3_coder parser reads it: a badge "6282" or a code "0042" is not a number. Any other value that
    parses as JSON (number, object, list, true/false/null) becomes that value, anything else stays a string (what
    Qwen3-Coder's template writes for a string argument)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return super().has_tool_call(text) or "<function=" in text

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
        out, bodies = self._split(text)
        for index, body in enumerate(bodies):
            where = f"tool call {index}"
            match = self._function.match(body)
            if match is None:
                out.errors.append(f"{where}: expected <function=NAME>...</function> inside <tool_call>")
                continue
            name, inner = match.group(1).strip(), match.group(2)
            texts = _string_parameters(tools, name)
            try:
                arguments = {p.group(1).strip(): p.group(2) if p.group(1).strip() in texts
                             else _json_or_text(p.group(2)) for p in self._parameter.finditer(inner)}
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



def _string_parameters(tools: list[dict] | None, name: str) -> set[str]:
    """The parameters of the offered tool `name` whose schema type is "string" and nothing else."""
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


class Llama3JsonToolParser:
    """Llama 3.x JSON calls: the whole answer is {"name": ..., "parameters": {...}} (or "arguments"), optionally
    after <|python_tag|>; several calls are joined by ";". Text that is not such an object is plain content."""

    python_tag = "<|python_tag|>"
    markers = (python_tag,)

    def has_tool_call(self, text: str) -> bool:
        stripped = text.strip()
        return self.python_tag in stripped or (stripped.startswith("{") and '"name"' in stripped)

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
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

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
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
            if not items:  # the marker made no call: said, as any other malformed call is
                out.errors.append(f"tool calls: an empty list after {self.marker}")
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

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
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

