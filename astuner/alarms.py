"""Alarms for tool use that fails silently.

A run can reach a high reward with zero tool calls: the parser never matches the model's format, or the policy
learns to answer without its tools. Neither raises an error. `ToolUseAlarm.observe` runs once per training step
and returns warnings:
  - parse failures: more than PARSE_FAILURE_WARN of the calls that tried a tool call could not be parsed; the
    warning names the parser and quotes one response it could not read;
  - silent tools: for SILENT_STEPS steps in a row the workflow offered tools but no tool call was parsed, while
    train/reward_mean rose; the warning names the parser and quotes one response. It repeats every SILENT_STEPS
    steps while the streak lasts;
  - tools never used: for UNUSED_STEPS steps in a row the workflow offered tools and the model made no tool call,
    or every call it made lacked a required argument of the offered schema, whatever the reward does. A base model
    that never calls its tools gives GRPO nothing to learn about them; the warning says so and names the remedy
    (a warm start), and the run's summary repeats it while it holds (`standing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from astuner.types import Episode, LLMCall

PARSE_FAILURE_WARN = 0.2
SILENT_STEPS = 3
# Two steps, not one: a single step of a small batch can miss tools by chance; a base model that cannot call them
# misses every step, and a user reading the console early should hear it before the run ends.
UNUSED_STEPS = 2
QUOTE_CHARS = 240
WARM_START_ADVICE = (
    "A model that makes no usable call to the offered tools gives GRPO nothing to learn about them: warm-start "
    "it first with `astuner warmstart --conf <yaml>` (an SFT on demonstrations of made-up tools shaped as yours, "
    "in its chat format), then run the GRPO command it prints (its checkpoint as astuner.model.path, in a folder "
    "of its own).")


def _quote(text: str) -> str:
    return repr(text[:QUOTE_CHARS] + ("..." if len(text) > QUOTE_CHARS else ""))


def missing_arguments(name: str, arguments: dict[str, Any], tools: list[dict] | None) -> list[str]:
    """The parameters the offered tool `name` lists as `required` (its JSON schema) that `arguments` lacks; []
    for a tool that was not offered (the parser flags those) or a schema without `required`."""
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            required = (function.get("parameters") or {}).get("required") or []
            return [r for r in required if not isinstance(arguments, dict) or r not in arguments]
    return []


def not_offered_calls(call: LLMCall) -> list[str]:
    """Names of the tool calls in `call`'s reply that name no tool its request offered (a warm-started model
    calling a made-up twin of a tool, say); [] when the offered schemas were not recorded."""
    if not call.tools:
        return []
    names = {(t.get("function", t) or {}).get("name") for t in call.tools}
    called = [(tc.get("function") or tc).get("name") for tc in (call.reply or {}).get("tool_calls") or []]
    return [str(n) for n in called if n not in names]


@dataclass(frozen=True)
class ToolUseFacts:
    """One step's tool use: model calls that offered tools, tool calls parsed from them, and those of the tool
    calls no tool could run: calls lacking a required argument (`incomplete`, one example "name(missing, ...)")
    and calls to a tool that was not offered (`not_offered`, one example name)."""

    step: int
    offered: int
    tool_calls: int
    incomplete: int
    example: str = ""
    not_offered: int = 0
    stray: str = ""

    @classmethod
    def of(cls, step: int, episodes: list[Episode]) -> "ToolUseFacts":
        offered = [c for e in episodes for c in e.calls if c.tools_offered]
        missing = [m for c in offered for m in c.missing_tool_arguments]
        stray = [n for c in offered for n in not_offered_calls(c)]
        called = sum(len((c.reply or {}).get("tool_calls") or []) for c in offered)
        return cls(step, len(offered), called, len(missing), missing[0] if missing else "", len(stray),
                   stray[0] if stray else "")

    @property
    def unused(self) -> bool:
        """Tools offered, and no call the tools could run: none made, or every one missing a required argument
        or naming a tool that was not offered."""
        return self.offered > 0 and self.incomplete + self.not_offered >= self.tool_calls


def unused_tools_warning(history: list[ToolUseFacts], steps: int = UNUSED_STEPS) -> str | None:
    """The warning when the last `steps` steps of `history` (one entry per step, in order) all offered tools and got
    no usable tool call; None otherwise. Counts over the whole streak, which may be longer than `steps`."""
    streak: list[ToolUseFacts] = []
    for facts in reversed(history):
        if not facts.unused:
            break
        streak.insert(0, facts)
    if len(streak) < steps:
        return None
    offered, called = sum(f.offered for f in streak), sum(f.tool_calls for f in streak)
    span = f"steps {streak[0].step}-{streak[-1].step}" if len(streak) > 1 else f"step {streak[0].step}"
    if called == 0:
        fact = f"the workflow offered tools in {offered} model calls and the model made no tool call " \
               "(rollout/tool_call_rate 0)"
    else:
        example = next((f.example for f in reversed(streak) if f.example), "")
        stray = next((f.stray for f in reversed(streak) if f.stray), "")
        why = [f"lacked a required argument of the offered schema (e.g. {example})"] if example else []
        why += [f"called a tool that was not offered ({stray})"] if stray else []
        fact = f"every one of the model's {called} tool calls {' or '.join(why)}, in {offered} model calls that " \
               "offered tools"
    return f"{span}: {fact}, whatever the reward does. {WARM_START_ADVICE}"


@dataclass
class ToolUseAlarm:
    silent_steps: int = SILENT_STEPS
    unused_steps: int = UNUSED_STEPS
    _streak: list[tuple[int, float]] = field(default_factory=list)  # (step, reward mean) with tools unused
    _history: list[ToolUseFacts] = field(default_factory=list)  # the steps of the current streak of unused tools

    def standing(self) -> str | None:
        """The tools-never-used warning if it still holds at the last step observed (for the run's summary)."""
        return unused_tools_warning(self._history, self.unused_steps)

    def observe(self, step: int, episodes: list[Episode], reward_mean: float) -> list[str]:
        warnings = self._observe_unused(step, episodes)
        return warnings + self._observe_parsing(step, episodes, reward_mean)

    def _observe_unused(self, step: int, episodes: list[Episode]) -> list[str]:
        """Said once per streak, when it reaches `unused_steps` steps; the summary repeats it while it holds."""
        facts = ToolUseFacts.of(step, episodes)
        self._history = self._history + [facts] if facts.unused else []  # the current streak only
        if len(self._history) != self.unused_steps:
            return []
        return [unused_tools_warning(self._history, self.unused_steps)]

    def _observe_parsing(self, step: int, episodes: list[Episode], reward_mean: float) -> list[str]:
        calls = [c for e in episodes for c in e.calls]
        offered = [c for c in calls if c.tools_offered]
        if not offered:
            self._streak.clear()
            return []
        parser = offered[0].tool_parser or "the configured"
        warnings = []
        attempted = [c for c in offered if c.tool_call_attempted]
        # A call the parser read but that names a tool not offered is the model's error, not the parser's.
        failed = [c for c in attempted if c.tool_call_parse_failed and not not_offered_calls(c)]
        if attempted and len(failed) / len(attempted) > PARSE_FAILURE_WARN:
            warnings.append(
                f"step {step}: the {parser} tool-call parser could not read {len(failed)} of the {len(attempted)} "
                f"responses that tried a tool call; one of them: {_quote(failed[0].response_text)}. Check "
                "astuner.rollout.tool_call_parser against the preflight table at start.")
        called = sum(len((c.reply or {}).get("tool_calls") or []) for c in calls)
        if called:
            self._streak.clear()
            return warnings
        self._streak.append((step, reward_mean))
        (first, start), (_, now) = self._streak[0], self._streak[-1]
        if len(self._streak) % self.silent_steps == 0 and now > start:
            warnings.append(
                f"steps {first}-{step}: the workflow offers tools but no tool call was parsed, while "
                f"train/reward_mean rose from {start:.3f} to {now:.3f}: the policy may be learning to answer without "
                f"its tools, or the {parser} parser does not read the model's calls. One response: "
                f"{_quote(offered[-1].response_text)}. See rollout/tool_call_rate.")
        return warnings
