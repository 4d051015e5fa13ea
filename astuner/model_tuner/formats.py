"""Chat formats by model family: reasoning parsers, and the table that picks the parsers from a chat template.

Reasoning parsers (`REASONING_PARSERS`, named by `rollout.reasoning_parser`):
  none   the whole output is content;
  think  `<think>...</think>` is reasoning, the rest content (Qwen3, QwQ, DeepSeek-R1). A template whose
         generation prompt already opens `<think>` makes the model write only `...</think>answer`; that is
         handled too. An unclosed `<think>` (generation cut at max_tokens) is all reasoning, no content. Text
         before a block stays content, later blocks are reasoning too, and a stray tag is dropped: the
         markers never reach the agent.
  channel  Gemma 4's `<|channel>thought\n...<channel|>`, split the same way.
Reasoning is kept out of the content handed back to the agent, returned as `reasoning_content`, and kept in the
recorded tokens (training sees exactly what was sampled).

Detection (`detect_formats`): the first row of `DETECTION_TABLE` whose marker occurs in the template source wins.
A template that cannot render tools gets astuner's builtin Hermes-style tool prompt, hence the hermes parser.
`rollout.tool_call_parser` / `rollout.reasoning_parser` other than `auto` override the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from astuner.model_tuner.tool_parser import TOOL_PARSERS


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str


class NoReasoningParser:
    markers: tuple[str, ...] = ()

    def split(self, text: str) -> ReasoningSplit:
        return ReasoningSplit(None, text)


class ThinkReasoningParser:
    open_tag, close_tag = "<think>", "</think>"
    markers = (open_tag, close_tag)

    def split(self, text: str) -> ReasoningSplit:
        if not any(m in text for m in self.markers):
            return ReasoningSplit(None, text)
        reasoning, content, rest = [], [], text
        close = rest.find(self.close_tag)
        if close >= 0 and self.open_tag not in rest[:close]:  # the generation prompt opened the block
            reasoning.append(rest[:close])
            rest = rest[close + len(self.close_tag):].lstrip("\n")
        while (start := rest.find(self.open_tag)) >= 0:
            content.append(rest[:start])
            rest = rest[start + len(self.open_tag):]
            close = rest.find(self.close_tag)
            if close < 0:  # generation cut at max_tokens: the rest is reasoning
                reasoning.append(rest)
                rest = ""
                break
            reasoning.append(rest[:close])
            rest = rest[close + len(self.close_tag):].lstrip("\n")
        content.append(rest)
        # A stray tag (a second </think>, an open tag inside the reasoning) reaches neither side.
        thought = "\n".join(self._reasoning(self._clean(r)) for r in reasoning) if reasoning else None
        answer = self._clean("".join(content))
        return ReasoningSplit(thought, answer if answer.strip() else "")

    def _clean(self, text: str) -> str:
        while any(m in text for m in self.markers):
            for marker in self.markers:
                text = text.replace(marker, "")
        return text

    def _reasoning(self, text: str) -> str:
        return text.strip("\n")


class ChannelReasoningParser(ThinkReasoningParser):
    """Gemma 4's thinking channel: `<|channel>thought\n...<channel|>answer`."""

    open_tag, close_tag = "<|channel>", "<channel|>"
    markers = (open_tag, close_tag)

    def _reasoning(self, text: str) -> str:
        text = text.strip("\n")
        return text[len("thought"):].lstrip("\n") if text.startswith("thought") else text


REASONING_PARSERS: dict[str, type] = {"none": NoReasoningParser, "think": ThinkReasoningParser,
                                      "channel": ChannelReasoningParser}

# (marker in the template source, tool parser, family) - first match wins, so specific markers come first.
DETECTION_TABLE: tuple[tuple[str, str, str], ...] = (
    ("<|tool_call>", "gemma4", "Gemma 4"),
    ("<function=", "qwen3_coder", "Qwen3-Coder XML"),
    ("[TOOL_CALLS]", "mistral", "Mistral"),
    ("<|python_tag|>", "llama3_json", "Llama 3.x"),
    ("<tool_call>", "hermes", "Hermes / Qwen2.5 / Qwen3"),
)
REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<channel|>", "channel"), ("</think>", "think"))


@dataclass
class ChatFormat:
    tool_parser: str
    reasoning_parser: str
    family: str  # what the detection matched, for the start-up table
    how: str  # "detected", "configured" or "builtin tool prompt"


def template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, (list, tuple)):
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return str(template or "")


def detect_formats(source: str, uses_builtin_tool_prompt: bool, tool_parser: str = "auto",
                   reasoning_parser: str = "auto") -> ChatFormat:
    """The parsers for a chat template source (rules in the module docstring)."""
    if tool_parser != "auto":
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {tool_parser!r}; available: {', '.join(TOOL_PARSERS)}")
        tool, family, how = tool_parser, tool_parser, "configured"
    elif uses_builtin_tool_prompt:
        tool, family, how = "hermes", "template without tools", "builtin tool prompt"
    else:
        tool, family, how = "hermes", "unrecognised template (hermes assumed)", "detected"
        for marker, name, fam in DETECTION_TABLE:
            if marker in source:
                tool, family = name, fam
                break
    if reasoning_parser != "auto":
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; "
                             f"available: {', '.join(REASONING_PARSERS)}")
        reasoning = reasoning_parser
    else:
        reasoning = next((name for marker, name in REASONING_MARKERS if marker in source), "none")
    return ChatFormat(tool, reasoning, family, how)

