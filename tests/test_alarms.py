"""Tool-use alarms: a parser that cannot read the model's calls, tools left unused while rewards rise, and tools
never used (no call, or no call with its required arguments), whatever the reward does."""

from __future__ import annotations

import json

import pytest

from scripted_engine import hermes_call, install

from astuner.alarms import ToolUseAlarm, ToolUseFacts, missing_arguments, unused_tools_warning
from astuner.types import Episode, LLMCall, Task


def _episode(text: str, called: bool = False, failed: bool = False, offered: bool = True,
             missing: list[str] | None = None) -> Episode:
    call = LLMCall([1], [2], [-0.1], "stop", 1.0, response_text=text, tools_offered=offered, tool_parser="hermes",
                   tool_call_attempted=called or failed, tool_call_parse_failed=failed,
                   missing_tool_arguments=missing or [],
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
    alarm = ToolUseAlarm(silent_steps=3, unused_steps=99)  # this warning alone (the next tests: tools never used)
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


CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert a value between units.",
    "parameters": {"type": "object", "required": ["value", "from_unit", "to_unit"], "properties": {
        "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}}}}}


def test_missing_arguments_are_the_offered_schemas_required_ones_the_call_lacks():
    assert missing_arguments("convert", {"value": 3}, [CONVERT]) == ["from_unit", "to_unit"]
    assert missing_arguments("convert", {"value": 3, "from_unit": "m", "to_unit": "ft"}, [CONVERT]) == []
    assert missing_arguments("convert", {}, [CONVERT["function"]]) == ["value", "from_unit", "to_unit"]  # bare
    assert missing_arguments("other", {}, [CONVERT]) == []  # not offered: the parser's to flag
    assert missing_arguments("f", {}, [{"type": "function", "function": {"name": "f"}}]) == []  # nothing required


def test_calls_to_a_tool_not_offered_count_as_unusable_and_not_as_parse_failures():
    """A warm-started model calling a made-up twin (`convert_units`) of the offered `convert`: the name check
    marks the call failed, but the parser read it; the tools are unused, and the warning says which name."""
    def twin() -> Episode:
        episode = _episode("<tool_call>...", called=True, failed=True)
        call = episode.calls[0]
        call.tools = [CONVERT]
        call.reply["tool_calls"] = [{"id": "c", "function": {"name": "convert_units", "arguments": "{}"}}]
        return episode

    alarm = ToolUseAlarm(unused_steps=2)
    assert ToolUseFacts.of(1, [twin()]).unused
    assert alarm.observe(1, [twin(), twin()], 0.0) == []  # no parse-failure warning: the parser is not at fault
    (warning,) = alarm.observe(2, [twin(), twin()], 0.0)
    assert "every one of the model's 4 tool calls called a tool that was not offered (convert_units)" in warning
    assert alarm.standing() == warning


def _facts(step, offered=4, tool_calls=0, incomplete=0, example=""):
    return ToolUseFacts(step, offered, tool_calls, incomplete, example)


def test_tools_never_used_for_two_steps_warn_with_the_fact_and_the_warm_start():
    assert unused_tools_warning([_facts(1)], steps=2) is None
    warning = unused_tools_warning([_facts(1), _facts(2), _facts(3)], steps=2)
    assert warning.startswith("steps 1-3: the workflow offered tools in 12 model calls and the model made no "
                              "tool call (rollout/tool_call_rate 0), whatever the reward does.")
    assert "warm-start it first" in warning and "astuner warmstart --conf <yaml>" in warning
    # Calls that all lack a required argument are as useless as none.
    lacking = [_facts(1, tool_calls=4, incomplete=4, example="convert(from_unit, to_unit)"), _facts(2)]
    assert unused_tools_warning(lacking, steps=2).startswith(
        "steps 1-2: every one of the model's 4 tool calls lacked a required argument of the offered schema "
        "(e.g. convert(from_unit, to_unit)), in 8 model calls that offered tools")
    # One complete call, or a step that offered no tools, ends the streak.
    assert unused_tools_warning([_facts(1), _facts(2, tool_calls=2, incomplete=1)], steps=2) is None
    assert unused_tools_warning([_facts(1), _facts(2, offered=0)], steps=2) is None


def test_tools_never_used_warn_once_per_streak_whatever_the_reward_and_stand_for_the_summary():
    alarm = ToolUseAlarm(unused_steps=2)
    plain = [_episode("The answer is 4.")]
    assert alarm.observe(1, plain, 0.5) == [] and alarm.standing() is None
    (warning,) = alarm.observe(2, plain, 0.0)  # the reward fell: said all the same
    assert warning.startswith("steps 1-2: the workflow offered tools in 2 model calls and the model made no tool call")
    assert alarm.observe(3, plain, 0.0) == [] and alarm.standing().startswith("steps 1-3:")
    alarm.observe(4, [_episode("x", called=True, missing=["f(a)"])], 0.0)  # a call, but without its argument
    assert alarm.standing().startswith("steps 1-4:")
    alarm.observe(5, [_episode("x", called=True)], 0.0)
    assert alarm.standing() is None


WORKFLOW = f'''
from astuner import Workflow, WorkflowOutput

class UnitAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        messages = [{{"role": "user", "content": workflow_task.task.main_query}}]
        reply = await model_tuner.chat(messages, tools=[{CONVERT!r}])
        return WorkflowOutput(reward=len(reply["content"]) / 100.0, metadata={{}})
'''


@pytest.mark.slow
def test_a_run_whose_tool_calls_all_lack_required_arguments_says_so_in_the_log_and_the_summary(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Through the real CLI, loop and monitor: every first call is scripted as `convert` with `value` only."""
    from astuner.cli import main

    install(monkeypatch, hermes_call("convert", "value", r"Convert (\\d+)"))
    (tmp_path / "unit_agent.py").write_text(WORKFLOW)
    rows = [{"question": f"Convert {n} m to ft.", "answer": "x"} for n in (3, 7, 12, 40)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "run.yaml").write_text(f"""
astuner:
  project_name: units
  model: {{path: {tiny_model_dir}}}
  task_reader: {{type: jsonl_dataset_file, jsonl_dataset_file: {{training: {{file_path: train.jsonl}}}}}}
  data: {{train_batch_size: 2, max_response_length: 64}}
  rollout: {{engine: hf, agentscope_workflow: unit_agent.py->UnitAgent, num_repeat: 2,
            max_response_length_in_one_turn: 40, max_model_len: 512, compute_madness_checklist: []}}
  trainer_common: {{total_training_steps: 2, val_before_train: false, test_freq: 99, save_freq: 99}}
""")
    code = main(["--conf", str(tmp_path / "run.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    assert code == 0
    train = [r for r in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
             if "rollout/tool_call_rate" in r]
    assert [r["rollout/tool_call_missing_args_rate"] for r in train] == [1.0, 1.0]
    said = ("steps 1-2: every one of the model's 8 tool calls lacked a required argument of the offered schema "
            "(e.g. convert(from_unit, to_unit))")
    assert said in captured.err  # the step's warning on the console
    summary = captured.out[captured.out.index("units: 2 steps"):]
    assert f"\nwarning: {said}" in summary and "warm-start it first" in summary
