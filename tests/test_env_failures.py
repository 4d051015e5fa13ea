"""A failed environment is not a zero (astuner/environments/failures.py): an environment call that raises or hangs
flags its episode, which is run again with a fresh environment (bounded), kept out of its group's statistics,
counted (env/failed, env/retried), and stops the run when it dominates a batch. Real TextArena and reasoning-gym
where a hub's environment is what fails."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import pytest

from astuner.algorithm.samples import episodes_to_samples
from astuner.environments import failures as env_failures
from astuner.environments.failures import EnvironmentFailure, dominating_failure, env_metrics
from astuner.errors import TrainingStalled
from astuner.monitor.metrics import pipeline_metrics, validation_metrics
from astuner.rollout import RolloutRunner
from astuner.task_judge.base_judge import BaseJudge
from astuner.types import FLAG_ENV_FAILED, FLAG_FAILED, Episode, Task
from astuner.workflow import Workflow, WorkflowOutput
from tests.test_rollout import TextEngine, settings

ATTEMPTS: Counter = Counter()  # (test, episode uid) -> attempts of that episode's environment


def test_the_counts_and_the_stop_rule_by_hand():
    def ep(retries: int, failed: bool) -> Episode:
        e = Episode(Task("t", "q"), 0, "u", flags=[FLAG_FAILED, FLAG_ENV_FAILED] if failed else [],
                    env_retries=retries, error_summary="environment g: step failed: boom")
        return e

    batch = [ep(0, False), ep(1, False), ep(2, True), ep(0, False)]
    # failed attempts: the 1 + 2 retried ones, and the one still failed; retried: 1 + 2
    assert env_metrics(batch) == {"env/failed": 4.0, "env/retried": 3.0}
    assert env_metrics(batch, "val/env") == {"val/env/failed": 4.0, "val/env/retried": 3.0}
    assert dominating_failure(batch) is None  # 1 of 4
    assert dominating_failure(batch[:2] + [ep(2, True)] * 2) is None  # 2 of 4: half is not more than half
    stop = dominating_failure([ep(2, True)] * 3 + [ep(0, False)])
    assert "3 of 4 episodes" in stop and "2 retries" in stop and "environment g: step failed: boom" in stop


def test_a_call_that_raises_or_hangs_is_the_environments_failure_even_when_swallowed():
    async def main():
        with env_failures.for_episode(timeout=0.1) as health:
            with pytest.raises(EnvironmentFailure, match=r"environment g: reset failed: ValueError: no board"):
                await env_failures.call("g", "reset", _raise, ValueError("no board"))
            start = time.monotonic()
            try:  # an agent's framework that swallows the exception does not hide it from the record
                await env_failures.call("g", "step", time.sleep, 0.5)
            except EnvironmentFailure:
                pass
            assert time.monotonic() - start < 0.45
            assert await env_failures.call("g", "close", lambda: 7) == 7
        return health

    health = asyncio.run(main())
    assert [str(f) for f in health.failures] == [
        "environment g: reset failed: ValueError: no board",
        "environment g: step failed: no answer within 0.1s (astuner.rollout.env_timeout)"]


def _raise(exc):
    raise exc


class FlakyEnvWorkflow(Workflow):
    """Reward by repeat index from the task (`rewards`); `fail_first[i]` first attempts of repeat i lose their
    environment, and the workflow swallows the error and returns a 0, as a careless framework would."""

    async def execute(self, workflow_task, model_tuner):
        meta = workflow_task.task.metadata
        key = (meta["test"], workflow_task.episode_uid)
        ATTEMPTS[key] += 1
        failing = ATTEMPTS[key] <= meta["fail_first"][workflow_task.repeat_index]
        await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        try:
            await env_failures.call("flaky-env", "step", _raise if failing else (lambda e: e),
                                    RuntimeError("server gone"))
        except EnvironmentFailure:
            return WorkflowOutput(reward=0.0, is_success=False)
        reward = meta["rewards"][workflow_task.repeat_index]
        return WorkflowOutput(reward=reward, is_success=reward >= 1)


class NoJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        raise AssertionError("the workflow gives its own reward")


def rollout(tokenizer, tasks, workflow=FlakyEnvWorkflow, judge=None, **kw):
    runner = RolloutRunner(settings(**kw), TextEngine(tokenizer), tokenizer, workflow, judge or NoJudge(None),
                           (tokenizer.eos_token_id,))
    try:
        return runner.run(tasks)
    finally:
        runner.close()


def flaky_task(test: str, rewards, fail_first) -> Task:
    return Task("g1", "Play.", metadata={"test": test, "rewards": rewards, "fail_first": fail_first})


def test_a_failed_environment_is_run_again_and_counted(demo_tokenizer):
    tasks = [flaky_task("retry", [1.0, 0.0, 1.0], [1, 0, 2])]
    episodes = rollout(demo_tokenizer, tasks, num_repeat=3, env_retries=2)
    assert [e.flags for e in episodes] == [[], [], []]  # every attempt that finished is a real one
    assert [e.env_retries for e in episodes] == [1, 0, 2]
    assert [e.reward for e in episodes] == [1.0, 0.0, 1.0]  # the game's reward, not the failed attempt's 0
    assert ATTEMPTS[("retry", episodes[2].episode_uid)] == 3
    metrics = pipeline_metrics(episodes, {})
    assert (metrics["env/failed"], metrics["env/retried"]) == (3.0, 3.0)


def test_an_environment_that_keeps_failing_is_left_out_of_its_group_not_a_zero(demo_tokenizer):
    # repeat 3's environment always fails; the workflow returns 0 for it, which must not become a reward
    tasks = [flaky_task("group", [1.0, 1.0, 0.0, 1.0], [0, 0, 0, 99])]
    episodes = rollout(demo_tokenizer, tasks, num_repeat=4, env_retries=2)
    failed = episodes[3]
    assert FLAG_ENV_FAILED in failed.flags and FLAG_FAILED in failed.flags and not failed.trainable
    assert failed.env_retries == 2 and ATTEMPTS[("group", failed.episode_uid)] == 3  # bounded: 1 + env_retries
    assert failed.error_source == "environment" and "server gone" in failed.error_summary
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=True, epsilon=0.0,
                                  max_sample_per_task=100)
    # GRPO over the group's three real rewards [1, 1, 0]: mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = 1/sqrt(3);
    # a failure counted as 0 would give [1, 1, 0, 0]: mean 1/2 and A = 0.866 for a win.
    assert sorted(round(s.advantage, 6) for s in samples) == [-1.154701, 0.57735, 0.57735]
    assert {s.episode_uid for s in samples} == {e.episode_uid for e in episodes[:3]}
    assert pipeline_metrics(episodes, {})["env/failed"] == 3.0


def test_failures_that_dominate_a_batch_stop_the_run_naming_the_environment(demo_tokenizer):
    tasks = [flaky_task("stop", [1.0, 1.0, 1.0], [99, 99, 0])]
    with pytest.raises(TrainingStalled, match=r"2 of 3 episodes .* 1 retries .*environment flaky-env: step "
                                              r"failed: RuntimeError: server gone"):
        rollout(demo_tokenizer, tasks, num_repeat=3, env_retries=1)


def test_a_validation_counts_its_failed_environments(demo_tokenizer):
    episodes = rollout(demo_tokenizer, [flaky_task("val", [1.0], [1])], num_repeat=1, env_retries=1)
    assert validation_metrics(episodes, [], 1)["val/env/failed"] == 1.0


# --- the hubs' own environments ------------------------------------------------------------------------------

FIRST_SEEN: set[str] = set()


def flaky_opponent(observation: str) -> str:
    """A scripted TicTacToe player whose first move of each game raises once (the game's side fails; its retry,
    the same game from the same seed, goes through)."""
    if "You are Player 1" in observation and observation not in FIRST_SEEN:  # the game's first turn for seat 1
        FIRST_SEEN.add(observation)
        raise ConnectionError("opponent service dropped the connection")
    return re.findall(r"'(\[\d\])'", observation.rsplit("Available Moves")[-1])[-1]


def first_free_square(tokenizer):
    def reply(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        return re.findall(r"'(\[\d\])'", prompt.rsplit("Available Moves")[-1])[0]
    return reply


def test_a_textarena_game_whose_side_fails_is_played_again_and_scored_by_the_game(demo_tokenizer):
    from astuner.environments.textarena import GameJudge, GameWorkflow
    from astuner.task_reader.textarena_reader import RECIPE_KEY

    recipe = {"env_id": "TicTacToe-v0", "env_kwargs": {}, "seed": 1, "opponent": "tests.test_env_failures->"
              "flaky_opponent", "max_turns": 9, "system_prompt": "Play well."}
    task = Task("ttt", "game", metadata={RECIPE_KEY: recipe})
    runner = RolloutRunner(settings(num_repeat=2, env_retries=1, max_env_worker=1),
                           TextEngine(demo_tokenizer, reply=first_free_square(demo_tokenizer)), demo_tokenizer,
                           GameWorkflow, GameJudge(None), (demo_tokenizer.eos_token_id,))
    try:
        episodes = runner.run([task])
    finally:
        runner.close()
    # first attempt: the opponent's first move raised; the retry plays the game out: O 0, X 8, O 1, X 7, O 2 wins
    assert [e.env_retries for e in episodes] == [1, 0]  # the second game meets an opponent already past its hiccup
    assert [(e.flags, e.reward, e.is_success) for e in episodes] == [([], 1.0, True)] * 2
    assert pipeline_metrics(episodes, {})["env/failed"] == 1.0


def test_a_reasoning_gym_scorer_that_raises_is_retried_then_left_out(demo_tokenizer, monkeypatch):
    from reasoning_gym.composite import CompositeDataset

    from astuner.environments.reasoning_gym import AnswerWorkflow, ReasoningGymJudge
    from astuner.task_reader.reasoning_gym_reader import RECIPE_KEY

    calls = []

    def broken(self, answer, entry):
        calls.append(answer)
        raise KeyError("metadata")

    monkeypatch.setattr(CompositeDataset, "score_answer", broken)
    spec = [{"name": "chain_sum", "weight": 1.0, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}]
    recipe = {"spec": {"datasets": spec, "seed": 5, "size": 4}, "index": 0, "system_prompt": "",
              "answer_from": "last_number", "answer_tag": "answer"}
    task = Task("rg", "What is 2 + 2?", metadata={RECIPE_KEY: recipe})
    runner = RolloutRunner(settings(num_repeat=2, env_retries=1, max_env_worker=1), TextEngine(demo_tokenizer),
                           demo_tokenizer, AnswerWorkflow, ReasoningGymJudge(None), (demo_tokenizer.eos_token_id,))
    try:
        with pytest.raises(TrainingStalled, match=r"chain_sum: score_answer failed: KeyError"):
            runner.run([task])  # both episodes failed twice: a batch the environment lost
    finally:
        runner.close()
    assert len(calls) == 4  # 2 episodes x (1 + env_retries)


def test_an_environment_service_that_does_not_answer_is_the_environments_failure():
    import socket

    from astuner.env_service import EnvServiceClient, EnvServiceError

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here
    client = EnvServiceClient(f"http://127.0.0.1:{port}", "arithmetic", request_timeout=1, retries=1, backoff_s=0.01)

    async def main():
        with env_failures.for_episode() as health:
            with pytest.raises(EnvServiceError) as caught:  # still the client's own error type for its callers
                await client.step("i", {"role": "assistant", "content": "x"})
        return health, caught.value

    health, error = asyncio.run(main())
    assert isinstance(error, EnvironmentFailure) and health.failures == [error]
    assert str(error).startswith(f"environment arithmetic: POST http://127.0.0.1:{port}/instances/i/step failed: "
                                 "the environment service did not answer")
