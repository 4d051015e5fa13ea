"""verifiers (v1) environments played unchanged (astuner/environments/verifiers_env.py), in their own environment
(.venv-vf: verifiers pins mcp==2.0.0; scripts/test.sh runs this file there). The tutorial's taskset
(tutorial/verifiers/sum_tools) is loaded as verifiers loads any, its own harness calls astuner's endpoint, its own
rewards score the trace; a harness that fails is the environment's failure, retried; the CLI trains it on the tiny
model."""

from __future__ import annotations

import json
import re

import pytest

from astuner.config import load_config
from astuner.environments.verifiers_env import EpisodeJudge, EpisodeWorkflow
from astuner.errors import TrainingStalled, UserError
from astuner.rollout import RolloutRunner
from astuner.task_reader import build_task_reader
from conftest import REPO
from test_rollout import TextEngine, settings

YAML = REPO / "tutorial" / "verifiers" / "verifiers.yaml"
SECTION = "astuner.task_reader.verifiers"


def reader(*overrides: str):
    loaded = load_config(YAML, [f"{SECTION}.size=4", f"{SECTION}.validation_size=2", *overrides])
    return build_task_reader(loaded.typed, YAML.parent)


def test_the_taskset_is_loaded_as_verifiers_loads_it_and_every_key_is_read():
    from test_run_contract import Recorder

    loaded = load_config(YAML, [f"{SECTION}.size=4", f"{SECTION}.validation_size=2"])
    reads: set[str] = set()
    tasks = build_task_reader(Recorder(loaded.typed, "", reads), YAML.parent).training_tasks()
    keys = {f"{SECTION}.{k}" for k in ("env_id", "env_dir", "env_args", "agent", "size", "validation_size")}
    assert keys <= reads
    assert [t.task_id for t in tasks] == ["train-0", "train-1", "train-2", "train-3"]
    assert re.fullmatch(r"What is \d \+ \d\? Use the add tool, then state the sum\.", tasks[0].main_query)
    assert [t.task_id for t in reader().validation_tasks()] == ["validation-0", "validation-1"]


def test_an_unknown_taskset_bad_arguments_and_too_many_tasks_stop_at_start():
    with pytest.raises(UserError, match="env_id='no_such_env': verifiers could not import it"):
        reader(f"{SECTION}.env_id=no_such_env")
    with pytest.raises(UserError, match="verifiers refused the environment 'sum_env'"):
        reader(f"+{SECTION}.env_args.no_such_key=1")
    with pytest.raises(UserError, match="has 300 tasks; size 400 and validation_size 2 ask for 402"):
        reader(f"{SECTION}.size=400")


def solver(tokenizer):
    """The engine's side of a model that uses the tool: `add` first, then the sum it returned."""

    def reply(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        results = re.findall(r"<tool_response>\s*(\d+)\s*</tool_response>", prompt)
        if not results:
            a, b = map(int, re.findall(r"What is (\d) \+ (\d)", prompt)[-1])
            return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        return f"The sum is {results[-1]}."
    return reply


def rollout(tokenizer, tasks, **kw):
    runner = RolloutRunner(settings(**{"num_repeat": 2, "max_env_worker": 2, "episode_timeout": 60.0, **kw}),
                           TextEngine(tokenizer, reply=solver(tokenizer)), tokenizer, EpisodeWorkflow,
                           EpisodeJudge(None), (tokenizer.eos_token_id,))
    try:
        return runner.run(tasks)
    finally:
        runner.close()


def test_verifiers_harness_calls_astuners_endpoint_and_its_rewards_score_the_episode(demo_tokenizer):
    episodes = rollout(demo_tokenizer, reader().training_tasks()[:2])
    for e in episodes:
        assert (e.flags, e.reward, e.is_success) == ([], 1.0, True), e.error
        assert e.metrics == {"reward/correct": 1.0, "reward/used_tool": 1.0, "tool_calls": 1.0, "turns": 2.0}
        first, second = e.calls  # recorded token-exactly by the endpoint: the tool call, then the answer
        assert first.tools_offered and second.tools_offered and first.tool_call_attempted
        assert demo_tokenizer.decode(second.response_ids, skip_special_tokens=True).startswith("The sum is ")


def test_a_harness_that_fails_is_the_environments_failure_played_again(demo_tokenizer, monkeypatch):
    tasks = reader().training_tasks()[:1]
    import sum_env  # loaded from tutorial/verifiers/sum_tools by the reader

    real, failures = sum_env.ToolLoopHarness.launch, []

    async def flaky(self, *args, **kwargs):
        if not failures:
            failures.append(1)
            raise ConnectionError("the harness lost its tool server")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(sum_env.ToolLoopHarness, "launch", flaky)
    episodes = rollout(demo_tokenizer, tasks, max_env_worker=1)
    assert [(e.flags, e.reward, e.env_retries) for e in episodes] == [([], 1.0, 1), ([], 1.0, 0)]

    async def broken(self, *args, **kwargs):
        raise ConnectionError("the harness lost its tool server")

    monkeypatch.setattr(sum_env.ToolLoopHarness, "launch", broken)
    with pytest.raises(TrainingStalled, match=r"environment sum_env: HarnessError failed: .*lost its tool server"):
        rollout(demo_tokenizer, tasks, env_retries=1)


@pytest.mark.slow
def test_the_tutorial_trains_on_the_tiny_model(tmp_path, tiny_model_dir):
    from astuner.cli import main

    assert main(["--conf", str(YAML), "--backbone", "debug", f"astuner.model.path={tiny_model_dir}",
                 f"astuner.experiment_dir={tmp_path}", "astuner.trainer_common.total_training_steps=2",
                 f"{SECTION}.size=4", f"{SECTION}.validation_size=2", "astuner.rollout.num_repeat=2",
                 "astuner.data.train_batch_size=2", "astuner.rollout.max_response_length_in_one_turn=8",
                 "astuner.trainer_common.max_idle_steps=100"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward_mean" in r]
    assert len(train) == 2 and all(r["train/failure_rate"] == 0.0 for r in train)
    assert "train/metrics/reward/correct" in train[0] and "val/metrics/tool_calls" in rows[0]
