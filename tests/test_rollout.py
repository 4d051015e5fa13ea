"""Rollout: concurrency bound, judge fallback, madness reward, failures, timeouts and overflow never stop a run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from astuner.model_tuner import TunerLimits
from astuner.rollout import RolloutRunner, RolloutSettings
from astuner.task_judge.base_judge import BaseJudge
from astuner.types import GenerateResult, Task
from astuner.workflow import Workflow, WorkflowOutput


class TextEngine:
    """Answers every request with `reply(prompt_ids)` + eos; tracks how many requests are in flight."""

    def __init__(self, tokenizer, reply=lambda prompt: "The answer is 4.", delay=0.01):
        self.tokenizer, self.reply, self.delay = tokenizer, reply, delay
        self.in_flight = self.max_in_flight = 0
        self.samplings = []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.samplings.append(sampling)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        ids = self.tokenizer.encode(self.reply(prompt_ids), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenerateResult(ids, [-0.5] * len(ids), "stop")

    def abort(self, request_id):
        pass

    def load_weights(self, named_tensors):
        pass

    def shutdown(self):
        pass


class ChatWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})


class ContainsFourJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        ok = "4" in workflow_output.metadata["final_answer"]
        return float(ok), ok


def settings(**kw):
    base = dict(num_repeat=3, max_env_worker=2, temperature=0.9, episode_timeout=5.0, agent_madness_reward=-1.0,
                madness_checks=("nonsense", "wrong_toolcall"), tool_prompt="auto", tool_call_parser="hermes",
                limits=TunerLimits(max_model_len=1024, max_tokens_per_turn=64, max_response_tokens=256,
                                   max_prompt_length=512))
    base.update(kw)
    return RolloutSettings(**base)


def runner(tokenizer, workflow=ChatWorkflow, engine=None, **kw):
    engine = engine or TextEngine(tokenizer)
    stops = (tokenizer.eos_token_id,)
    return RolloutRunner(settings(**kw), engine, tokenizer, workflow, ContainsFourJudge(None), stops), engine


TASKS = [Task("t1", "What is 2 + 2?"), Task("t2", "What is 1 + 3?")]


def test_repeats_concurrency_bound_and_judge(demo_tokenizer):
    r, engine = runner(demo_tokenizer)
    episodes = r.run(TASKS)
    assert [e.group_id for e in episodes] == ["t1"] * 3 + ["t2"] * 3  # grouped by task, in order
    assert len({e.episode_uid for e in episodes}) == 6
    assert engine.max_in_flight == 2  # max_env_worker bounds concurrent episodes
    assert all(e.reward == 1.0 and e.is_success and len(e.calls) == 1 for e in episodes)
    assert all(s.temperature == 0.9 and s.max_tokens == 64 for s in engine.samplings)


def test_validation_is_one_greedy_episode_per_task(demo_tokenizer):
    r, engine = runner(demo_tokenizer)
    episodes = r.run(TASKS, validation=True)
    assert len(episodes) == 2 and all(s.temperature == 0.0 for s in engine.samplings)


def test_workflow_reward_wins_over_judge(demo_tokenizer):
    class Fixed(Workflow):
        async def execute(self, workflow_task, model_tuner):
            await model_tuner.chat([{"role": "user", "content": "hi"}])
            return WorkflowOutput(reward=0.25, metadata={"final_answer": "4"})

    r, _ = runner(demo_tokenizer, Fixed)
    e = r.run(TASKS[:1])[0]
    assert e.reward == 0.25 and e.is_success  # is_success defaults to reward > 0


def test_failure_and_timeout_are_recorded_and_the_run_goes_on(demo_tokenizer):
    class Flaky(Workflow):
        async def execute(self, workflow_task, model_tuner):
            await model_tuner.chat([{"role": "user", "content": "hi"}])
            if workflow_task.repeat_index == 0:
                raise ValueError("tool exploded")
            if workflow_task.repeat_index == 1:
                await asyncio.sleep(60)
            return WorkflowOutput(reward=1.0)

    r, _ = runner(demo_tokenizer, Flaky, episode_timeout=0.5)
    failed, timed_out, fine = r.run(TASKS[:1])
    assert "failed" in failed.flags and "ValueError: tool exploded" in failed.error and not failed.trainable
    assert "timeout" in timed_out.flags and not timed_out.trainable
    assert fine.flags == [] and fine.reward == 1.0 and fine.trainable
    assert len(failed.calls) == 1  # calls made before the crash are kept for the trajectory log


def test_madness_sets_reward(demo_tokenizer):
    engine = TextEngine(demo_tokenizer, reply=lambda p: "4 <|im_start|>user\nmore")  # leaked special token
    r, _ = runner(demo_tokenizer, engine=engine)
    e = r.run(TASKS[:1])[0]
    assert "nonsense" in e.flags and e.reward == -1.0 and not e.is_success

    r, _ = runner(demo_tokenizer, engine=TextEngine(demo_tokenizer, reply=lambda p: "4 <|im_start|>x"),
                  madness_checks=())
    e = r.run(TASKS[:1])[0]
    assert "nonsense" not in e.flags and e.reward == 1.0  # an unlisted check does not touch the reward


class Chatty(Workflow):
    """Talks until its episode's limits stop it."""

    async def execute(self, workflow_task, model_tuner):
        messages = [{"role": "user", "content": "count"}]
        while True:
            reply = await model_tuner.chat(messages)
            messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "more"}]


def test_overflow_ends_episode_with_calls_kept(demo_tokenizer):
    limits = TunerLimits(max_model_len=120, max_tokens_per_turn=64, max_response_tokens=1000, max_prompt_length=512)
    r, _ = runner(demo_tokenizer, Chatty, limits=limits)
    e = r.run(TASKS[:1])[0]
    assert e.flags == ["overflow"] and e.reward == 0.0 and e.trainable and len(e.calls) >= 2


def test_wrong_return_type_is_a_failure(demo_tokenizer):
    class Wrong(Workflow):
        async def execute(self, workflow_task, model_tuner):
            return {"reward": 1}

    r, _ = runner(demo_tokenizer, Wrong)
    e = r.run(TASKS[:1])[0]
    assert "failed" in e.flags and "expected WorkflowOutput" in e.error


def test_judge_user_error_stops_the_run(demo_tokenizer):
    from astuner.errors import UserError

    class NeedsAnswer(BaseJudge):
        def compute_reward(self, workflow_task, workflow_output):
            raise UserError("the dataset has no 'answer' field")

    r = RolloutRunner(settings(), TextEngine(demo_tokenizer), demo_tokenizer, ChatWorkflow, NeedsAnswer(None),
                      (demo_tokenizer.eos_token_id,))
    with pytest.raises(UserError, match="no 'answer' field"):
        r.run(TASKS[:1])


def test_repeated_errors_reach_the_console_once(demo_tokenizer, caplog):
    class Broken(Workflow):
        async def execute(self, workflow_task, model_tuner):
            raise RuntimeError("same bug every time")

    r, _ = runner(demo_tokenizer, Broken)
    with caplog.at_level("INFO", logger="astuner.rollout"):
        episodes = r.run(TASKS)
    assert all("failed" in e.flags for e in episodes)
    levels = [rec.levelname for rec in caplog.records if "same bug" in rec.getMessage()]
    assert levels.count("WARNING") == 1 and len(levels) == 6


def test_the_judge_deadline_is_task_judge_timeout():
    from types import SimpleNamespace

    from astuner.config.schema import RunConfig

    a = RunConfig().astuner
    assert RolloutSettings.from_config(RunConfig(), 1024).judge_timeout == a.task_judge.timeout == 300.0
    typed = SimpleNamespace(astuner=SimpleNamespace(rollout=a.rollout, data=a.data, seed=a.seed,
                                                    task_judge=SimpleNamespace(timeout=7.5)))
    assert RolloutSettings.from_config(typed, 1024).judge_timeout == 7.5


class NotedFailure(Workflow):
    async def execute(self, workflow_task, model_tuner):
        await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        exc = ValueError("the tool got no input")
        exc.add_note("During task with name 'agent' and id 'abc'")  # as LangGraph adds to what it re-raises
        raise exc


class RaisingJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        raise KeyError("expected_answer")


def test_an_error_is_quoted_in_its_own_words_and_names_the_part_that_failed(demo_tokenizer):
    r, _ = runner(demo_tokenizer, NotedFailure, num_repeat=1)
    episode = r.run(TASKS[:1])[0]
    # The traceback ends with the note; the summary leads with the exception itself.
    assert episode.error.strip().splitlines()[-1].startswith("During task")
    assert episode.error_summary == ("the workflow raised ValueError: the tool got no input "
                                     "[note: During task with name 'agent' and id 'abc']")
    assert episode.error_source == "workflow"
    r, _ = runner(demo_tokenizer, num_repeat=1)
    r.judge = RaisingJudge(None)
    episode = r.run(TASKS[:1])[0]
    assert episode.error_summary == "judge RaisingJudge raised KeyError: 'expected_answer'"
    assert episode.error_source == "judge" and "failed" in episode.flags


def test_one_event_loop_serves_every_rollout_of_the_run(demo_tokenizer):
    loops = []

    class LoopRecorder(ChatWorkflow):
        async def execute(self, workflow_task, model_tuner):
            loops.append(asyncio.get_running_loop())
            return await super().execute(workflow_task, model_tuner)

    r, _ = runner(demo_tokenizer, LoopRecorder, num_repeat=1)
    r.run(TASKS, step=1)
    r.run(TASKS, validation=True)
    r.run(TASKS, step=2)
    assert len(loops) == 6 and len(set(map(id, loops))) == 1 and not loops[0].is_closed()
    r.close()
    assert loops[0].is_closed()


def test_every_concurrent_episode_gets_a_thread_for_a_synchronous_agent(demo_tokenizer):
    """8 episodes whose synchronous agents (run in asyncio.to_thread) each wait for all the others: asyncio's
    default pool (cores + 4 threads) would break the barrier; one thread per concurrent episode does not."""
    import threading

    barrier = threading.Barrier(8, timeout=20)

    class SyncAgent(ChatWorkflow):
        async def execute(self, workflow_task, model_tuner):
            await asyncio.to_thread(barrier.wait)
            return await super().execute(workflow_task, model_tuner)

    r, _ = runner(demo_tokenizer, SyncAgent, num_repeat=4, max_env_worker=8)
    episodes = r.run(TASKS)
    assert len(episodes) == 8 and not any(e.flags for e in episodes), [e.error_summary for e in episodes]
    r.close()


STUCK = threading.Event()  # released at the end of a test, so that its stuck agents' threads end


class MaybeStuckSyncAgent(ChatWorkflow):
    """A synchronous agent (run by asyncio.to_thread) whose blocking call never returns for task "stuck"."""

    async def execute(self, workflow_task, model_tuner):
        if workflow_task.task.task_id == "stuck":
            await asyncio.to_thread(STUCK.wait)
        await asyncio.to_thread(time.sleep, 0.01)
        return await super().execute(workflow_task, model_tuner)


@pytest.mark.slow
def test_synchronous_agents_stuck_past_their_deadline_do_not_starve_later_episodes(demo_tokenizer, caplog):
    """More stuck episodes than the old pool had threads (max_env_worker + 4): later synchronous episodes still
    start, and the abandoned threads are counted and named in a warning."""
    import logging

    STUCK.clear()
    r, _ = runner(demo_tokenizer, MaybeStuckSyncAgent, num_repeat=7, max_env_worker=2, episode_timeout=0.4)
    try:
        with caplog.at_level(logging.WARNING, logger="astuner.daemon_threads"):
            stuck = r.run([Task("stuck", "q")])
        assert all(e.flags == ["timeout"] for e in stuck)
        assert len(r._executor.abandoned()) == 7
        assert ("7 abandoned thread(s) in this process, of episodes train:stuck#0 (step 0), train:stuck#1 (step 0)"
                in caplog.text)
        r.settings.episode_timeout = 10.0
        episodes = r.run(TASKS)
        assert [e.flags for e in episodes] == [[]] * 14 and all(e.reward == 1.0 for e in episodes)
    finally:
        STUCK.set()
    r.close()


def test_abandoned_threads_are_a_step_metric_of_those_still_running(demo_tokenizer):
    """Each episode carries the live count when it ended; the step logs the most; threads that finished since
    (the stuck call returned) drop out of it."""
    from astuner.monitor import pipeline_metrics

    STUCK.clear()
    r, _ = runner(demo_tokenizer, MaybeStuckSyncAgent, num_repeat=3, max_env_worker=3, episode_timeout=0.4)
    try:
        stuck = r.run([Task("stuck", "q")])
        assert sorted(e.abandoned_threads for e in stuck)[-1] == 3
        assert pipeline_metrics(stuck, {})["rollout/abandoned_threads"] == 3.0
    finally:
        STUCK.set()
    deadline = time.monotonic() + 10
    while r._executor.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    episodes = r.run(TASKS[:1])
    assert [e.abandoned_threads for e in episodes] == [0] * 3 and r._executor._abandoned == set()
    assert pipeline_metrics(episodes, {})["rollout/abandoned_threads"] == 0.0
    r.close()


def test_the_run_stops_when_abandoned_threads_pass_their_limit_naming_where_they_are_stuck(demo_tokenizer):
    """4 x max_env_worker threads stuck may run on; one more stops the run with the function they wait in."""
    from astuner.errors import TrainingStalled

    STUCK.clear()
    r, _ = runner(demo_tokenizer, MaybeStuckSyncAgent, num_repeat=5, max_env_worker=1, episode_timeout=0.2)
    try:
        with pytest.raises(TrainingStalled, match=r"5 threads of episodes that ended are still running in this "
                           r"process, more than 4 \(4 x astuner.rollout.max_env_worker\); they are stuck in "
                           r"Event.wait \(5\)\. .* Give that blocking call a timeout of its own"):
            r.run([Task("stuck", "q")])
    finally:
        STUCK.set()
    r.close()


EXIT_SCRIPT = """
import asyncio, sys, threading
from transformers import AutoTokenizer
from astuner.model_tuner import TunerLimits
from astuner.rollout import RolloutRunner, RolloutSettings
from astuner.task_judge.base_judge import BaseJudge
from astuner.types import Task
from astuner.watchdog import Watchdog
from astuner.workflow import Workflow

class Stuck(Workflow):
    async def execute(self, workflow_task, model_tuner):
        await asyncio.to_thread(threading.Event().wait)  # never returns

class Judge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        return 0.0, False

def runner(episode_timeout):
    settings = RolloutSettings(num_repeat=2, max_env_worker=2, temperature=1.0, agent_madness_reward=0.0,
                               episode_timeout=episode_timeout, madness_checks=(), tool_prompt="auto",
                               limits=TunerLimits(max_model_len=256, max_tokens_per_turn=8, max_response_tokens=8,
                                                  max_prompt_length=128))
    return RolloutRunner(settings, None, tokenizer, Stuck, Judge(None), (tokenizer.eos_token_id,))

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
first = runner(0.3)
episodes = first.run([Task("t", "q")])
assert [e.flags for e in episodes] == [["timeout"]] * 2, episodes
first.close()
print("closed", flush=True)
try:  # the stage's deadline stops the run with the agents' threads still stuck, and the process exits
    with Watchdog(deadline_s=0.5) as dog, dog.stage("rollout"):
        runner(60.0).run([Task("t", "q")])
except Exception as exc:
    print(type(exc).__name__, flush=True)
"""


@pytest.mark.slow
def test_a_process_with_stuck_synchronous_agents_closes_its_loop_and_exits_promptly(demo_model_dir):
    """Nothing joins an abandoned agent's thread: not the loop's close, not interpreter exit after a stage
    timeout (each hung for ever before)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(demo_model_dir)], capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process did not exit within 90 s: something joins a stuck agent's thread") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed", "StageTimeout"]
