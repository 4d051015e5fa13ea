"""Parsing tool calls out of generated text.

Parsers live in an explicit registry (`TOOL_PARSERS`), named by `rollout.tool_parser`. A parser never raises on
bad model output: what it cannot use becomes an entry of `ParsedOutput.errors`, which the `wrong_toolcall`
madness check turns into a flag, so a malformed call costs reward instead of crashing the episode.
"""

from __future__ import annotations

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
        call = ParsedToolCall(id=f"{id_prefix}_{index}", name=name, arguments=arguments)
        if tool_names is not None:
            if not tool_names:
                return call, f"{where}: called {name!r} but no tools were offered"
            if name not in tool_names:
                # The call is still returned: the agent framework answers it with a "not found" tool message,
                # which is useful feedback for the model.
                return call, f"{where}: unknown tool {name!r} (offered: {', '.join(sorted(tool_names))})"
        return call, None


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """An instance of the parser registered under `name`."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}") from None
