"""Alarms for tool use that fails silently.

A run can reach a high reward with zero tool calls: the parser never matches the model's format, or the policy
learns to answer without its tools. Neither raises an error. `ToolUseAlarm.observe` runs once per training step
and returns warnings:
  - parse failures: more than PARSE_FAILURE_WARN of the calls that tried a tool call could not be parsed; the
    warning names the parser and quotes one response it could not read;
  - silent tools: for SILENT_STEPS steps in a row the workflow offered tools but no tool call was parsed, while
    train/reward_mean rose; the warning names the parser and quotes one response. It repeats every SILENT_STEPS
    steps while the streak lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from astuner.types import Episode

PARSE_FAILURE_WARN = 0.2
SILENT_STEPS = 3
QUOTE_CHARS = 240


def _quote(text: str) -> str:
    return repr(text[:QUOTE_CHARS] + ("..." if len(text) > QUOTE_CHARS else ""))


@dataclass
class ToolUseAlarm:
    silent_steps: int = SILENT_STEPS
    _streak: list[tuple[int, float]] = field(default_factory=list)  # (step, reward mean) with tools unused

    def observe(self, step: int, episodes: list[Episode], reward_mean: float) -> list[str]:
        calls = [c for e in episodes for c in e.calls]
        offered = [c for c in calls if c.tools_offered]
        if not offered:
            self._streak.clear()
            return []
        parser = offered[0].tool_parser or "the configured"
        warnings = []
        attempted = [c for c in offered if c.tool_call_attempted]
        failed = [c for c in attempted if c.tool_call_parse_failed]
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
