"""The shared ground of the tool parsers (`tool_parser.py`): the parsed records, the parser protocol, strict JSON
reading, and the checks every parsed call passes before it reaches the agent (markers, nesting, tool names).
"""

from __future__ import annotations

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

    def parse(self, text: str, tool_names: set[str] | None = None, id_prefix: str = "call",
              tools: list[dict] | None = None) -> ParsedOutput:
        """Split `text` into plain content and tool calls.

        tool_names: the names offered in this call; None skips the name check, an empty set means no tools were
        offered (so any call is an error). id_prefix: call ids are f"{id_prefix}_{index}". tools: the offered
        schemas; a format that writes argument values as bare text (Qwen3-Coder's) reads them by their declared
        type, so a string argument "0042" stays a string.
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

