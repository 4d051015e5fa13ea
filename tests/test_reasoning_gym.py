"""reasoning-gym played unchanged (astuner/environments/reasoning_gym.py): the real package's generators are the
tasks, its scorers the reward, its names and configs checked at start, a scorer that raises is a failure and not
a zero. The tutorial's command runs as written in tests/test_tutorial_commands.py."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from test_model_tuner import make_tuner

from astuner.config import load_config
from astuner.environments import reasoning_gym as env
from astuner.errors import UserError
from astuner.task_judge.loading import judge_spec
from astuner.workflow import workflow_spec
from astuner.task_reader import build_task_reader
from astuner.task_reader import reasoning_gym_reader as reader
from astuner.workflow import WorkflowOutput, WorkflowTask

from conftest import REPO

CHAIN = {"name": "chain_sum", "weight": 1.0, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}


def _config(tmp_path, reader: dict, *overrides: str):
    path = tmp_path / "rg.yaml"
    path.write_text(json.dumps({"astuner": {"seed": 5, "task_reader": {"type": "reasoning_gym",
                                                                         "reasoning_gym": reader}}}))
    return load_config(path, list(overrides))


def _tasks(tmp_path, reader: dict, *overrides: str):
    loaded = _config(tmp_path, reader, *overrides)
    built = build_task_reader(loaded.typed, loaded.config_dir)
    return built.training_tasks(), built.validation_tasks()


def test_tasks_are_the_generators_own_items(tmp_path):
    import reasoning_gym
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    train, val = _tasks(tmp_path, {"datasets": [CHAIN], "size": 12, "validation_size": 5})
    # seed null: the run's seed (5); validation: the same datasets under another seed.
    ours = CompositeDataset(CompositeConfig(size=12, seed=5, datasets=[DatasetSpec("chain_sum", 1.0, CHAIN["config"])]))
    assert [t.main_query for t in train] == [ours[i]["question"] for i in range(12)]
    assert [t.metadata["answer"] for t in train] == [ours[i]["answer"] for i in range(12)]
    assert [t.task_id for t in train[:2]] == ["train-0", "train-1"] and len(val) == 5
    held_out = CompositeDataset(CompositeConfig(size=5, seed=5 + reader.VALIDATION_SEED_OFFSET,
                                                datasets=[DatasetSpec("chain_sum", 1.0, CHAIN["config"])]))
    assert [t.main_query for t in val] == [held_out[i]["question"] for i in range(5)]
    assert all(t.metadata["dataset"] == "chain_sum" for t in train + val)
    assert reasoning_gym.create_dataset  # the real package, not a stand-in
    again, _ = _tasks(tmp_path, {"datasets": [CHAIN], "size": 12, "seed": 5, "validation_size": 0})
    assert [t.main_query for t in again] == [t.main_query for t in train]


def _judge(task, reply: str):
    output = WorkflowOutput(metadata={"final_answer": reply})
    reward, success = env.ReasoningGymJudge().compute_reward(WorkflowTask(task), output)
    return reward, success, output.metrics


def test_the_judge_is_the_datasets_own_scorer_on_the_extracted_answer(tmp_path):
    train, _ = _tasks(tmp_path, {"datasets": [CHAIN], "size": 4, "validation_size": 0})
    task = train[0]
    right = task.metadata["answer"]
    wrong = str(int(right) + 1)
    assert _judge(task, f"so <answer>{right}</answer>") == (1.0, True, {"score/chain_sum": 1.0, "answered": 1.0})
    assert _judge(task, f"<answer>{right}</answer> no: <answer>{wrong}</answer>")[:2] == (0.0, False)  # the last
    assert _judge(task, f"It is {right}.") == (0.0, False, {"score/chain_sum": 0.0, "answered": 0.0})  # no tag
    # chain_sum's scorer reads a decimal: "+07.00" is 7 (its own tolerance, not ours).
    assert _judge(task, f"<answer>+0{right}.00</answer>")[:2] == (1.0, True)

    last = _tasks(tmp_path, {"datasets": [CHAIN], "size": 4, "validation_size": 0, "answer_from": "last_number"})[0][0]
    assert _judge(last, f"{task.main_query[-9:]} {right}. The answer is {right}.")[:2] == (1.0, True)
    assert _judge(last, f"The answer is {wrong}.")[:2] == (0.0, False)
    assert _judge(last, "I do not know")[2]["answered"] == 0.0


def test_extraction_modes():
    assert reader.extract("a <answer> 12 </answer> b", "tag", "answer") == "12"
    assert reader.extract("<final>x</final>", "tag", "final") == "x"
    assert reader.extract("no tag 4", "tag", "answer") is None
    assert reader.extract("3 + 4 = 7, or 1,234 or -2.5.", "last_number", "answer") == "-2.5"
    assert reader.extract("total 1,234 apples", "last_number", "answer") == "1234"
    assert reader.extract("  ok \n", "reply", "answer") == "ok"


def test_datasets_mix_by_weight_and_each_is_scored_and_logged_by_its_own_scorer(tmp_path):
    mix = [CHAIN, {"name": "gcd", "weight": 3.0, "config": {"min_value": 2, "max_value": 30, "max_numbers": 2}}]
    train, _ = _tasks(tmp_path, {"datasets": mix, "size": 200, "validation_size": 0})
    counts = {name: sum(t.metadata["dataset"] == name for t in train) for name in ("chain_sum", "gcd")}
    assert counts["chain_sum"] + counts["gcd"] == 200 and 30 < counts["chain_sum"] < 75  # ~ 1/4
    gcd = next(t for t in train if t.metadata["dataset"] == "gcd")
    assert _judge(gcd, f"<answer>{gcd.metadata['answer']}</answer>")[2] == {"score/gcd": 1.0, "answered": 1.0}


@pytest.mark.parametrize("entry, says", [
    ({"name": "chain_summ"}, "Did you mean chain_sum"),
    ({"name": "chain_sum", "config": {"max_term": 3}}, "max_term, which ChainSumConfig does not take; it takes"),
    ({"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}, "max_terms must be >= min_terms"),
])
def test_bad_names_and_configs_stop_at_start_naming_the_key(tmp_path, entry, says):
    reader._composite.cache_clear()
    with pytest.raises(UserError, match="astuner.task_reader.reasoning_gym.datasets") as caught:
        _tasks(tmp_path, {"datasets": [entry], "size": 3})
    assert says in str(caught.value)


def test_no_datasets_and_a_missing_package_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="datasets is empty"):
        _tasks(tmp_path, {"datasets": [], "size": 3})
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(UserError, match=r"pip install 'astuner\[reasoning-gym\]'"):
        _tasks(tmp_path, {"datasets": [CHAIN], "size": 3})


def test_the_environment_brings_its_workflow_and_judge_unless_yours_are_named(tmp_path):
    typed = _config(tmp_path, {"datasets": [CHAIN]}).typed
    assert workflow_spec(typed) == "astuner.environments.reasoning_gym->AnswerWorkflow"
    assert judge_spec(typed) == "astuner.environments.reasoning_gym->ReasoningGymJudge"
    mine = _config(tmp_path, {"datasets": [CHAIN]}, "astuner.rollout.agentscope_workflow='my.py->Agent'",
                   "astuner.task_judge.judge_protocol='my.py->Judge'").typed
    assert (workflow_spec(mine), judge_spec(mine)) == ("my.py->Agent", "my.py->Judge")
    plain = load_config(REPO / "tutorial/quickstart/quickstart.yaml").typed  # other readers: unchanged
    assert judge_spec(plain) == "boxed_judge.py->BoxedAnswerJudge"


def test_the_workflow_asks_with_the_named_system_prompt(tmp_path, demo_tokenizer):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    train, _ = _tasks(tmp_path, {"datasets": [CHAIN], "size": 2, "validation_size": 0, "system_prompt": "direct"})
    tuner, engine = make_tuner(demo_tokenizer, ["<answer>3</answer>"])
    output = asyncio.run(env.AnswerWorkflow().execute(WorkflowTask(train[0]), tuner))
    prompt = demo_tokenizer.decode(engine.prompts[0])
    assert SYSTEM_PROMPTS["direct"] in prompt and train[0].main_query in prompt
    assert output.metadata["final_answer"] == "<answer>3</answer>" and output.reward is None


def _register_flaky_dataset() -> str:
    """A reasoning-gym dataset (registered as a user would) whose scorer raises on odd items."""
    from dataclasses import dataclass

    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    name = "astuner_test_flaky"

    @dataclass
    class FlakyConfig:
        seed: int | None = None
        size: int = 10

        def validate(self) -> None:
            pass

    class FlakyDataset(ProceduralDataset):
        def __init__(self, config: FlakyConfig) -> None:
            super().__init__(config=config, seed=config.seed, size=config.size)

        def __getitem__(self, idx: int) -> dict:
            return {"question": f"What is 2 + 2? (item {idx})", "answer": "4",
                    "metadata": {"source_dataset": name, "source_index": idx}}

        def score_answer(self, answer, entry) -> float:
            if entry["metadata"]["source_index"] % 2:
                raise ConnectionError("the scorer's backend went away")
            return super().score_answer(answer, entry)

    if name not in DATASETS:
        register_dataset(name, FlakyDataset, FlakyConfig)
    return name


def test_a_scorer_that_raises_flags_its_episodes_and_they_are_not_counted_as_zeros(demo_tokenizer):
    from test_rollout import TextEngine, settings

    from astuner.monitor.metrics import episode_metrics
    from astuner.rollout import RolloutRunner

    name = _register_flaky_dataset()
    spec = reader.composite_spec([{"name": name, "weight": 1.0, "config": {}}], 2, 0)
    tasks = reader.item_tasks(spec, "train", "", "last_number", "answer")
    runner = RolloutRunner(settings(num_repeat=2), TextEngine(demo_tokenizer), demo_tokenizer, env.AnswerWorkflow,
                           env.ReasoningGymJudge(None), (demo_tokenizer.eos_token_id,))
    episodes = runner.run(tasks)
    good, bad = episodes[:2], episodes[2:]
    assert all(e.reward == 1.0 and e.trainable for e in good)
    # the environment's failure: retried (rollout.env_retries, 2) with a fresh environment, then left out
    assert all({"failed", "env_failed"} <= set(e.flags) and not e.trainable and e.error_source == "environment"
               and e.env_retries == 2 for e in bad)
    assert "ConnectionError: the scorer's backend went away" in bad[0].error_summary
    metrics = episode_metrics(episodes, "train")
    # The failed half is out of the reward statistics (counted as zeros, the mean would be 0.5), and counted.
    assert metrics["train/reward_mean"] == 1.0 and metrics["train/failure_rate"] == 0.5
