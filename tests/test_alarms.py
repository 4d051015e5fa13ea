"""Tool-use alarms: a parser that cannot read the model's calls, and tools left unused while rewards rise."""

from __future__ import annotations

from astuner.alarms import ToolUseAlarm
from astuner.types import Episode, LLMCall, Task


def _episode(text: str, called: bool = False, failed: bool = False, offered: bool = True) -> Episode:
    call = LLMCall([1], [2], [-0.1], "stop", 1.0, response_text=text, tools_offered=offered, tool_parser="hermes",
                   tool_call_attempted=called or failed, tool_call_parse_failed=failed,
                   reply={"role": "assistant", "content": text,
                          **({"tool_calls": [{"id": "c", "function": {"name": "f"}}]} if called else {})})
    return Episode(Task("t", "q"), 0, "t#0", calls=[call])


def test_parse_failures_name_the_parser_and_quote_a_response():
    alarm = ToolUseAlarm()
    episodes = [_episode("<tool_call>{broken", failed=True), _episode("ok", called=True)]
    (warning,) = alarm.observe(1, episodes, 0.0)
    assert "step 1: the hermes tool-call parser could not read 1 of the 2 responses" in warning
    assert "'<tool_call>{broken'" in warning


def test_unused_tools_while_rewards_rise_warn_every_silent_streak():
    alarm = ToolUseAlarm(silent_steps=3)
    plain = [_episode("The answer is 4.")]
    assert alarm.observe(1, plain, 0.1) == [] and alarm.observe(2, plain, 0.3) == []
    (warning,) = alarm.observe(3, plain, 0.5)
    assert warning.startswith("steps 1-3: the workflow offers tools but no tool call was parsed")
    assert "rose from 0.100 to 0.500" in warning and "hermes parser" in warning and "'The answer is 4.'" in warning
    assert alarm.observe(4, plain, 0.6) == [] and alarm.observe(5, plain, 0.6) == []
    assert alarm.observe(6, plain, 0.7)  # the streak goes on: said again
    # A call resets the streak; rewards that do not rise, or no tools offered, never warn.
    alarm.observe(7, [_episode("x", called=True)], 0.7)
    assert [alarm.observe(s, plain, 0.2) for s in (8, 9, 10)] == [[], [], []]
    assert ToolUseAlarm(silent_steps=1).observe(1, [_episode("x", offered=False)], 1.0) == []
