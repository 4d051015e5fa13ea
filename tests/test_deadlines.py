"""Episode deadlines that hold whatever the agent does, with a real AgentScope ReActAgent called as
`await agent(msg)` (whose `__call__` swallows CancelledError), and overflows a workflow swallows."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentscope.agent import ReActAgent
from agentscope.formatter import DashScopeChatFormatter
from agentscope.memory import InMemoryMemory
from agentscope.message import Msg, TextBlock
from agentscope.tool import Toolkit, ToolResponse

from astuner.model_tuner import EpisodeOverflow, EpisodeTimeout, TunerLimits
from astuner.rollout import RolloutRunner, RolloutSettings
from astuner.task_judge.base_judge import BaseJudge
from astuner.types import GenerateResult, Task
from astuner.workflow import Workflow, WorkflowOutput

TOOL_CALL = '<tool_call>{"name": "look_up", "arguments": {"what": "x"}}</tool_call>'
SEEN: dict[str, list] = {"caught": []}


class SlowScriptedEngine:
    """Answers with a tool call; the first calls take `fast` seconds, later ones `slow` (so one is pending at the
    deadline). Records when each request started and which were aborted."""

    def __init__(self, tokenizer, fast=0.05, slow=30.0, fast_calls=2):
        self.tokenizer, self.fast, self.slow, self.fast_calls = tokenizer, fast, slow, fast_calls
        self.started: list[float] = []
        self.aborted: list[str] = []
        self.cancelled = 0

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.started.append(time.monotonic())
        try:
            await asyncio.sleep(self.fast if len(self.started) <= self.fast_calls else self.slow)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = self.tokenizer.encode(TOOL_CALL, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenerateResult(ids, [-0.1] * len(ids), "stop")

    def abort(self, request_id):
        self.aborted.append(request_id)

    def load_weights(self, named_tensors):
        pass

    def shutdown(self):
        pass


async def look_up(what: str) -> ToolResponse:
    """Look something up.

    Args:
        what (`str`): what to look up.
    """
    return ToolResponse(content=[TextBlock(type="text", text=f"{what} = 1")])


class StubbornAgentWorkflow(Workflow):
    """Calls the agent as `await agent(msg)`, twice, and catches whatever happens: it always claims success."""

    async def execute(self, workflow_task, model_tuner):
        toolkit = Toolkit()
        toolkit.register_tool_function(look_up)
        agent = ReActAgent(name="a", sys_prompt="Use tools.", model=model_tuner, formatter=DashScopeChatFormatter(),
                           toolkit=toolkit, memory=InMemoryMemory(), max_iters=10)
        agent.set_console_output_enabled(False)
        for _ in range(2):
            try:
                await agent(Msg("user", workflow_task.task.main_query, role="user"))
            except Exception as exc:  # noqa: BLE001 - the point: user code that swallows our exception
                SEEN["caught"].append(exc)
        return WorkflowOutput(reward=1.0, metadata={"final_answer": "done"})


class SwallowOverflowWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        try:
            await model_tuner.chat([{"role": "user", "content": "word " * 1500}])
        except EpisodeOverflow as exc:
            SEEN["caught"].append(exc)
        return WorkflowOutput(reward=1.0, metadata={"final_answer": "done"})


class NeverJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        raise AssertionError("a cut-off episode must not be judged")


def make_runner(tokenizer, workflow, engine, timeout, judge_timeout=300.0):
    settings = RolloutSettings(
        num_repeat=1, max_env_worker=4, temperature=1.0, episode_timeout=timeout, agent_madness_reward=0.0,
        madness_checks=(), tool_prompt="auto", tool_call_parser="hermes",
        limits=TunerLimits(max_model_len=2048, max_tokens_per_turn=64, max_response_tokens=4096,
                           max_prompt_length=1000),
        judge_timeout=judge_timeout,
    )
    return RolloutRunner(settings, engine, tokenizer, workflow, NeverJudge(None), (tokenizer.eos_token_id,))


def test_deadline_holds_for_a_react_agent_that_swallows_cancellation(demo_tokenizer):
    SEEN["caught"].clear()
    engine = SlowScriptedEngine(demo_tokenizer)
    timeout = 1.0
    started = time.monotonic()
    (episode,) = make_runner(demo_tokenizer, StubbornAgentWorkflow, engine, timeout).run([Task("t", "Find x.")])
    elapsed = time.monotonic() - started

    # Flagged whatever the workflow returned, not judged, not trained on.
    assert episode.flags == ["timeout"] and not episode.trainable and episode.reward == 0.0
    assert "timed out after 1s" in episode.error
    # The pending (slow) request was aborted rather than waited for.
    assert engine.aborted and engine.cancelled >= 1
    assert elapsed < timeout + 2.0
    # After the deadline no request reached the engine: the agent's next call failed at once.
    deadline = started + timeout
    assert all(t < deadline for t in engine.started)
    assert any(isinstance(e, EpisodeTimeout) for e in SEEN["caught"])


def test_overflow_flags_the_episode_even_when_the_workflow_swallows_it(demo_tokenizer):
    SEEN["caught"].clear()
    engine = SlowScriptedEngine(demo_tokenizer)
    (episode,) = make_runner(demo_tokenizer, SwallowOverflowWorkflow, engine, 10.0).run([Task("t", "q")])
    assert SEEN["caught"] and episode.flags == ["overflow"] and episode.reward == 0.0
    assert engine.started == []  # refused before reaching the engine


class AsyncJudge(BaseJudge):
    async def compute_reward(self, workflow_task, workflow_output):
        await asyncio.sleep(0)
        return 0.5, True


class SlowSyncJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        time.sleep(0.3)  # blocking: must run in a worker thread, not on the event loop
        return 1.0, True


class QuickWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        return WorkflowOutput(reward=None, metadata={"final_answer": "x"})


def test_judges_run_off_the_event_loop_or_as_coroutines(demo_tokenizer):
    engine = SlowScriptedEngine(demo_tokenizer)
    runner = make_runner(demo_tokenizer, QuickWorkflow, engine, 10.0)
    runner.judge = AsyncJudge(None)
    assert [e.reward for e in runner.run([Task("t", "q")])] == [0.5]
    runner.judge = SlowSyncJudge(None)
    started = time.monotonic()
    episodes = runner.run([Task(f"t{i}", "q") for i in range(4)])
    assert [e.reward for e in episodes] == [1.0] * 4
    assert time.monotonic() - started < 1.0  # 4 x 0.3 s judged concurrently, not one after another


RELEASE = threading.Event()  # set at the end of a test, so that the hung judge threads of the tests end


class HungSyncJudge(BaseJudge):
    """Never answers for task "hang" (blocks its thread until the test ends); 1.0 for the others."""

    def compute_reward(self, workflow_task, workflow_output):
        if workflow_task.task.task_id == "hang":
            RELEASE.wait()
        return 1.0, True


class HungAsyncJudge(BaseJudge):
    async def compute_reward(self, workflow_task, workflow_output):
        if workflow_task.task.task_id == "hang":
            await asyncio.Event().wait()
        return 1.0, True


class OneCallWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        return WorkflowOutput(reward=None, metadata={"final_answer": "x"})


@pytest.mark.parametrize("judge", [HungSyncJudge, HungAsyncJudge])
def test_a_hung_judge_flags_its_episode_and_the_others_still_train(demo_tokenizer, judge):
    from astuner.algorithm.samples import episodes_to_samples

    RELEASE.clear()
    engine = SlowScriptedEngine(demo_tokenizer, fast_calls=100)
    runner = make_runner(demo_tokenizer, OneCallWorkflow, engine, 10.0, judge_timeout=0.5)
    runner.judge = judge(None)
    result = []
    thread = threading.Thread(target=lambda: result.append(runner.run([Task("hang", "q"), Task("a", "q"),
                                                                          Task("b", "q")])), daemon=True)
    thread.start()
    thread.join(timeout=0.5 + 1.5)  # run() also closed its loop without waiting for the hung judge
    RELEASE.set()
    assert result, "the rollout waited for the hung judge"
    hung, *others = result[0]
    assert hung.flags == ["failed", "judge_timeout"] and not hung.trainable and hung.reward == 0.0
    assert "did not answer within 0.5s (astuner.task_judge.timeout)" in hung.error
    assert all(e.flags == [] and e.trainable and e.reward == 1.0 for e in others)
    samples = episodes_to_samples([hung, *others], adv_estimator="grpo", norm_by_std=False, epsilon=0.0,
                                  max_sample_per_task=4)
    assert {s.episode_uid for s in samples} == {e.episode_uid for e in others}


class SlowTerm(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        time.sleep(0.4)
        return 1.0, True


@pytest.mark.slow
def test_the_judges_of_an_episode_share_one_deadline(demo_tokenizer):
    from astuner.task_judge.shaping import CombinedJudge

    engine = SlowScriptedEngine(demo_tokenizer, fast_calls=100)
    runner = make_runner(demo_tokenizer, OneCallWorkflow, engine, 10.0, judge_timeout=0.6)
    runner.judge = CombinedJudge([("one", 1.0, SlowTerm(None), True), ("two", 1.0, SlowTerm(None), False)])
    (episode,) = runner.run([Task("t", "q")])  # each term alone is within 0.6 s, the two together are not
    assert "judge_timeout" in episode.flags and not episode.trainable
    runner.settings.judge_timeout = 2.0
    (episode,) = runner.run([Task("t", "q")])
    assert episode.flags == [] and episode.reward == 2.0


class LongWorkflow(Workflow):
    """Uses most of its episode's time, then succeeds (and leaves the reward to the judge)."""

    async def execute(self, workflow_task, model_tuner):
        await asyncio.sleep(0.8)
        return WorkflowOutput(reward=None, metadata={"final_answer": "x"})


class CriticJudge(BaseJudge):
    """Asks an auxiliary model served by astuner, after the episode's own deadline has passed."""

    async def compute_reward(self, workflow_task, workflow_output):
        await asyncio.sleep(0.5)
        reply = await workflow_task.auxiliary_models["critic"].chat([{"role": "user", "content": "Correct?"}])
        return float(bool(reply)), True


def test_a_judges_calls_to_a_served_auxiliary_model_have_the_judges_deadline(demo_tokenizer):
    from types import SimpleNamespace

    from astuner.auxiliary import AuxiliaryPool
    from astuner.model_tuner import ChatRenderer
    from astuner.model_tuner.tool_parser import TOOL_PARSERS

    critic = SlowScriptedEngine(demo_tokenizer, fast_calls=100)
    typed = SimpleNamespace(astuner=SimpleNamespace(auxiliary_models={
        "critic": SimpleNamespace(max_tokens=32, temperature=0.0)}))
    served = {"critic": (critic, demo_tokenizer, ChatRenderer(demo_tokenizer), TOOL_PARSERS["hermes"](),
                         (demo_tokenizer.eos_token_id,), 2048)}
    runner = make_runner(demo_tokenizer, LongWorkflow, SlowScriptedEngine(demo_tokenizer), 1.0, judge_timeout=5.0)
    runner.judge, runner.auxiliary = CriticJudge(None), AuxiliaryPool(typed, served)
    (episode,) = runner.run([Task("t", "q")])  # judged 1.3 s into a 1 s episode, within its 5 s judging
    assert episode.flags == [] and episode.reward == 1.0, episode.error_summary
    assert len(critic.started) == 1 and episode.metrics["aux/critic/calls"] == 1.0


class CancelsItself(Workflow):
    async def execute(self, workflow_task, model_tuner):
        asyncio.current_task().cancel()  # e.g. a "stop" path of the user's own
        await asyncio.sleep(1)
        return WorkflowOutput(reward=1.0)


class FrameworkCancels(Workflow):
    async def execute(self, workflow_task, model_tuner):
        raise asyncio.CancelledError  # as a framework does when its own run is torn down


class InterruptedAgent(Workflow):
    """An AgentScope agent interrupted while it waits for the model: AgentBase.__call__ swallows the
    CancelledError and answers "interrupted", and the workflow returns as if the agent had answered."""

    async def execute(self, workflow_task, model_tuner):
        agent = ReActAgent(name="a", sys_prompt="Use tools.", model=model_tuner, formatter=DashScopeChatFormatter(),
                           toolkit=Toolkit(), memory=InMemoryMemory(), max_iters=3)
        agent.set_console_output_enabled(False)

        async def interrupt_soon():
            await asyncio.sleep(0.2)
            await agent.interrupt()

        interrupter = asyncio.ensure_future(interrupt_soon())
        reply = await agent(Msg("user", workflow_task.task.main_query, role="user"))
        await interrupter
        return WorkflowOutput(reward=0.0, metadata={"final_answer": reply.get_text_content()})


class SwallowsItsCancel(Workflow):
    async def execute(self, workflow_task, model_tuner):
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass  # swallowed, never taken back (Task.uncancel)
        return WorkflowOutput(reward=1.0)


async def _tool(fails: bool) -> None:
    await asyncio.sleep(0.01 if fails else 0.1)
    if fails:
        raise ValueError("tool failed")


class ParallelTools(Workflow):
    """Tools run in parallel in a TaskGroup (a common agent pattern); the parent waits in the group's exit. With
    `one_fails`, one tool raises and the agent handles it: CPython 3.11 leaves the parent's `cancelling()` at 1."""

    one_fails = False

    async def execute(self, workflow_task, model_tuner):
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_tool(self.one_fails))
                tg.create_task(_tool(False))
        except* ValueError:
            pass
        async with asyncio.timeout(0.05):  # a timeout the workflow sets itself, not reached
            await asyncio.sleep(0)
        try:
            async with asyncio.timeout(0.01):  # ... and one it reaches and handles
                await asyncio.sleep(1)
        except TimeoutError:
            pass
        return WorkflowOutput(reward=1.0)


class ParallelToolsOneFails(ParallelTools):
    one_fails = True


@pytest.mark.parametrize("workflow, flagged", [(CancelsItself, True), (FrameworkCancels, True),
                                               (InterruptedAgent, True), (SwallowsItsCancel, True),
                                               (ParallelTools, False), (ParallelToolsOneFails, False)])
def test_a_workflow_cancelled_by_anything_but_its_deadline_is_flagged_not_trained(demo_tokenizer, workflow, flagged):
    """Cancelled (ended cancelled, or a cancellation swallowed, as AgentScope's interrupt() is) is flagged;
    asyncio's own task groups and timeouts, which cancel and take it back, are not."""
    engine = SlowScriptedEngine(demo_tokenizer, fast_calls=0)  # every model call waits: the agent is mid-call
    (episode,) = make_runner(demo_tokenizer, workflow, engine, 10.0).run([Task("t", "q")])
    if not flagged:
        assert episode.flags == [] and episode.reward == 1.0, episode.error_summary
        return
    assert episode.flags == ["failed"] and not episode.trainable
    assert episode.error_summary.startswith("the workflow was cancelled, not by astuner's deadline")
    if workflow is InterruptedAgent:
        assert "by agentscope.agent._agent_base (" in episode.error_summary
