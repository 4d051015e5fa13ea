"""Rollout: run the user's workflow `num_repeat` times per task, concurrently, and turn each run into an Episode.

Per episode: a fresh Workflow instance and a fresh ModelTuner (which records every LLM call), a deadline, and
never a crash of the run: an exception or timeout is logged with its traceback and the episode is flagged
(failed / timeout) and left out of training. A context overflow ends the episode early (flag "overflow",
reward 0.0, its calls are kept); which limit cut it, and what training does with it, is astuner/cuts.py's.
When the workflow returns reward=None the judge scores it. If a madness check
listed in `rollout.compute_madness_checklist` fired on any call, the reward becomes `agent_madness_reward`.

The deadline is enforced where astuner has control, because a workflow may not let a cancellation through
(AgentScope's `AgentBase.__call__` catches `CancelledError` and returns an "interrupted" message, so
`asyncio.wait_for` would return normally and leave the rest of the workflow without a limit). At the deadline the
ModelTuner expires (its pending engine requests are aborted and every later call raises `EpisodeTimeout` at once),
the workflow task is cancelled, and the episode is flagged timeout whatever the workflow returns. A workflow that
still does not finish within `CANCEL_GRACE_S` is abandoned. Likewise an overflow the ModelTuner recorded flags the
episode even when the workflow caught the exception, and so does a tool that could not start (its sandbox:
astuner/tools/failures.py): flagged `tool_infra_failed` and `failed`, not trained on, even when the agent's framework
handed the error to the model as a tool result. The run stops after `TOOL_INFRA_BATCHES_TO_STOP` batches in a row
(a `run`: a step's rollout, or a validation) in which some tool could not start and none did: counted per batch, not
per episode, since one brief hiccup hits every episode running at that moment. An environment that failed (a
call of a game, a scorer or a server that raised or timed out: astuner/environments/failures.py) flags its episode
`env_failed`, which is run again with a fresh workflow up to `rollout.env_retries` times; a batch that environments
still fail in more than half of stops the run.
A workflow cancelled by anything but that deadline (its own code, its framework, an AgentScope `interrupt()` the
agent swallowed) is flagged `failed`: its reward 0 is not the model's. Who sent a cancellation the workflow
swallowed is known from its task (`rollout_episode.WorkflowJob`): asyncio's and anyio's primitives (timeouts, task
groups) take back their own, so a count they leave (CPython 3.11's TaskGroup) is not one.

Judging has its own deadline, `task_judge.timeout` seconds from when the episode's judging starts (after the
workflow returned), shared by every judge that scores the episode: the terms of `task_judge.combine` run in turn
inside it, each with what the earlier ones left; a judge's calls to an auxiliary model served by astuner stop at
it too, not at the episode's deadline. Episodes are judged concurrently, as they finished, so judging
adds at most `task_judge.timeout` to a step beyond its last workflow. Past the deadline an async judge is
cancelled, and a sync judge's worker thread (which cannot be killed) is abandoned, still running, and never
waited for, not even at shutdown (`base_judge.in_daemon_thread`). The episode is flagged `judge_timeout` (and
`failed`, so it is left out of training and counted in failure_rate like an episode whose judge raised), and the
run goes on.

All rollouts of a run (training steps and validations) run on one event loop, kept open between steps. Clients
that SDKs and users build once per process (`langchain_openai` caches one `httpx.AsyncClient` per base URL; an
`openai.AsyncOpenAI` made at import time) bind their connections to the loop of their first request and would
fail on any other ("Event loop is closed"). Episodes stay isolated by their own keys, deadlines and
cancellation; whatever a step leaves running is cancelled when it ends (`_cancel_leftovers`). The loop's default
executor (`asyncio.to_thread`, where synchronous agents run) starts a daemon thread per call
(`daemon_threads.DaemonExecutor`): an agent stuck in a blocking call past its deadline holds only its own thread,
which nothing waits for (not later episodes, not the loop's close, not the exit), and is logged as abandoned;
past `ABANDONED_THREADS_PER_WORKER` x max_env_worker such threads still running, the run stops.

Sampling seeds are derived from (astuner.seed, step, episode uid), so an episode samples the same tokens whatever
else runs beside it, and a resumed run repeats the run it continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from astuner import cuts, daemon_threads, logs
from astuner.engine.base import InferenceEngine
from astuner.environments import failures as env_failures
from astuner.errors import TrainingStalled
from astuner.model_tuner import ModelTuner, TunerLimits
from astuner.model_tuner.chat_format import ChatRenderer
from astuner.model_tuner.formats import REASONING_PARSERS, detect_formats, template_source
from astuner.model_tuner.frontends.gateway import Gateway
from astuner.model_tuner.roster import Roster
from astuner.model_tuner.tool_parser import TOOL_PARSERS
from astuner.rollout_episode import WorkflowJob, apply_madness, episode_seed, judge_output, workflow_output
from astuner.task_judge.base_judge import BaseJudge
from astuner.tools import failures as tool_failures
from astuner.types import FLAG_ENV_FAILED, FLAG_FAILED, FLAG_OVERFLOW, FLAG_TIMEOUT, FLAG_TOOL_INFRA_FAILED
from astuner.types import Episode, Task
from astuner.watchdog import watch
from astuner.workflow import WorkflowOutput, WorkflowTask

log = logging.getLogger(__name__)

# Seconds a cancelled workflow gets to unwind after its deadline before the rollout stops waiting for it.
CANCEL_GRACE_S = 5.0
# Threads abandoned by ended episodes (stuck in a blocking call) that may run on, per rollout.max_env_worker,
# before the run stops (daemon_threads): a few stuck calls are an agent's bad luck, more a leak that grows each step.
ABANDONED_THREADS_PER_WORKER = 4
# Batches in a row in which tools could not start (their sandbox) and none started, before the run stops: one is a
# hiccup, this many a broken machine, on which every episode would be thrown away.
TOOL_INFRA_BATCHES_TO_STOP = 2


@dataclass
class RolloutSettings:
    num_repeat: int
    max_env_worker: int
    temperature: float
    episode_timeout: float
    agent_madness_reward: float
    madness_checks: tuple[str, ...]
    limits: TunerLimits
    tool_prompt: str
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    judge_timeout: float = 300.0
    on_cut: str = "train"  # what training does with a cut episode (astuner/cuts.py)
    env_timeout: float = 60.0  # one environment call (astuner/environments/failures.py)
    env_retries: int = 2  # runs again of an episode whose environment failed

    @classmethod
    def from_config(cls, typed, max_model_len: int) -> "RolloutSettings":
        """From the typed config; `max_model_len` is rollout.max_model_len resolved against the model's limit."""
        r, d = typed.astuner.rollout, typed.astuner.data
        return cls(
            num_repeat=r.num_repeat,
            max_env_worker=r.max_env_worker,
            temperature=r.temperature,
            episode_timeout=r.episode_timeout,
            agent_madness_reward=r.agent_madness_reward,
            madness_checks=tuple(r.compute_madness_checklist),
            limits=TunerLimits(
                max_model_len=max_model_len,
                max_tokens_per_turn=r.max_response_length_in_one_turn,
                max_response_tokens=d.max_response_length,
                max_prompt_length=d.max_prompt_length,
                context_policy=r.context_policy,
                summary_max_tokens=r.summary_max_tokens,
            ),
            tool_prompt=r.tool_prompt,
            tool_call_parser=r.tool_call_parser,
            reasoning_parser=r.reasoning_parser,
            seed=typed.astuner.seed,
            top_p=r.top_p,
            top_k=r.top_k,
            judge_timeout=typed.astuner.task_judge.timeout,
            on_cut=r.on_cut,
            env_timeout=r.env_timeout,
            env_retries=r.env_retries,
        )


class RolloutRunner:
    """Turns tasks into episodes through the user's workflow and an inference engine."""

    def __init__(
        self,
        settings: RolloutSettings,
        engine: InferenceEngine,
        tokenizer,
        workflow_cls: type,
        judge: BaseJudge,
        stop_token_ids: tuple[int, ...],
        config: Any = None,
        auxiliary=None,
        roster: Roster | None = None,
    ) -> None:
        self.settings = settings
        self.auxiliary = auxiliary  # auxiliary.AuxiliaryPool or None
        self.engine = engine
        self.roster = roster  # several models (astuner.models): which engine serves each agent; None: `engine`
        self.tokenizer = tokenizer
        self.workflow_cls = workflow_cls
        self.judge = judge
        self.stop_token_ids = stop_token_ids
        self.config = config
        self._seen_errors: set[str] = set()
        self._tool_infra_streak = 0  # batches in a row whose tools could not start, none starting
        self.renderer = ChatRenderer(tokenizer, settings.tool_prompt)
        self.chat_format = detect_formats(template_source(tokenizer), self.renderer.uses_builtin_tool_prompt,
                                          settings.tool_call_parser, settings.reasoning_parser)
        self.parser = TOOL_PARSERS[self.chat_format.tool_parser]()
        self.reasoning_parser = REASONING_PARSERS[self.chat_format.reasoning_parser]()
        self.gateway = Gateway()
        self._loop: asyncio.AbstractEventLoop | None = None  # every rollout of the run (module docstring)
        self._executor: daemon_threads.DaemonExecutor | None = None  # the loop's default executor

    def stop_texts(self) -> tuple[str, ...]:
        """End-of-turn markers as text (the stop tokens and the tokenizer's eos)."""
        texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in self.stop_token_ids]
        return tuple(dict.fromkeys(texts + [getattr(self.tokenizer, "eos_token", None) or ""]))

    def close(self, auxiliary: bool = True) -> None:
        """Stop the loopback endpoint, if an agent started it, and (unless `auxiliary` is False: a caller that
        shares the pool between runners) the auxiliary models' engines."""
        self.gateway.close()
        if self._loop is not None and not self._loop.is_closed():
            _close_loop(self._loop)
        if auxiliary and self.auxiliary is not None:
            self.auxiliary.shutdown()

    def run(
        self,
        tasks: list[Task],
        *,
        validation: bool = False,
        on_episode_done: Callable[[Episode], None] | None = None,
        step: int = 0,
        sampled_repeats: int | None = None,
    ) -> list[Episode]:
        """Training: `num_repeat` sampled episodes per task. Validation: one greedy episode per task, or, with
        `sampled_repeats` (pass@k), that many episodes per task sampled at the training temperature."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            # Synchronous agents (smolagents) run in `asyncio.to_thread`: a daemon thread per call, so neither a
            # pool's cap nor an agent stuck past its deadline holds up other episodes, the loop's close or the exit.
            self._executor = daemon_threads.DaemonExecutor(
                "astuner-episode", max_abandoned=ABANDONED_THREADS_PER_WORKER * self.settings.max_env_worker,
                limit_source=f"{ABANDONED_THREADS_PER_WORKER} x astuner.rollout.max_env_worker")
            self._loop.set_default_executor(self._executor)
        try:
            return self._loop.run_until_complete(
                self.run_async(tasks, validation=validation, on_episode_done=on_episode_done, step=step,
                               sampled_repeats=sampled_repeats)
            )
        finally:
            _cancel_leftovers(self._loop)

    async def run_async(self, tasks, *, validation=False, on_episode_done=None, step: int = 0,
                        sampled_repeats: int | None = None) -> list[Episode]:
        if validation and sampled_repeats is not None:
            repeats, temperature = sampled_repeats, self.settings.temperature
        else:
            repeats = 1 if validation else self.settings.num_repeat
            temperature = 0.0 if validation else self.settings.temperature
        gate = asyncio.Semaphore(self.settings.max_env_worker)

        async def one(task: Task, index: int) -> Episode:
            async with gate:
                with watch("episode", f"{'val' if validation else 'train'}:{task.task_id}#{index}"):
                    episode = await self._episode(task, index, temperature, validation, step)
                    retries = 0
                    while FLAG_ENV_FAILED in episode.flags and retries < self.settings.env_retries:
                        retries += 1  # a fresh workflow, so a fresh environment (env_failures' docstring)
                        log.info("episode %s: its environment failed (%s); running it again (%d of %d)",
                                 episode.episode_uid, episode.error_summary, retries, self.settings.env_retries)
                        episode = await self._episode(task, index, temperature, validation, step)
                    episode.env_retries = retries
            if on_episode_done is not None:
                on_episode_done(episode)
            return episode

        jobs = [one(task, i) for task in tasks for i in range(repeats)]
        healths: list[tool_failures.ToolHealth] = []
        with tool_failures.for_batch(healths):
            episodes = list(await asyncio.gather(*jobs))
        self._check_tool_infra(healths)
        stop = env_failures.dominating_failure(episodes)
        if stop is not None:
            raise TrainingStalled(stop)
        return episodes

    async def _episode(
        self, task: Task, repeat_index: int, temperature: float, validation: bool, step: int = 0
    ) -> Episode:
        tag = ("val" if temperature == 0 else "val-sampled") if validation else "train"
        episode = Episode(task=task, repeat_index=repeat_index, episode_uid=f"{tag}:{task.task_id}#{repeat_index}")
        timeout = self.settings.episode_timeout
        # This episode's task: its blocking calls are named after it (uids repeat across steps, the step tells).
        thread_owner = f"{episode.episode_uid} (step {step})"
        daemon_threads.owner.set(thread_owner)
        logs.EPISODE.set(episode.episode_uid)  # what the episode's code prints goes to the run's log (logs.py)
        tuner = self.new_tuner(episode.episode_uid, temperature, step, timeout)
        aux_models, aux_usage = ({}, {}) if self.auxiliary is None else self.auxiliary.for_episode(
            episode.episode_uid, tuner.deadline)
        tuner.auxiliary_models = aux_models
        workflow_task = WorkflowTask(task, repeat_index, episode.episode_uid, validation, aux_models)
        start = time.perf_counter()
        # The workflow's task reports its tools' start failures and its environment's failures here.
        with tool_failures.for_episode() as tools, env_failures.for_episode(self.settings.env_timeout) as env:
            job = WorkflowJob(self._execute(workflow_task, tuner), loop=asyncio.get_running_loop())
        await _await_deadline(job, tuner, episode.episode_uid, timeout)
        output, problem = workflow_output(episode, job, tuner)
        if problem is not None and not env.failures:  # an environment's failure is logged as such below
            self._log_error(episode, problem)
        tuner.close()  # revoke the episode's API keys: a late request gets 401 and records nothing
        logs.end_episode_prints(episode.episode_uid)
        if self._executor is not None:
            self._executor.abandon(thread_owner)  # its blocking calls still running: counted and logged
            episode.abandoned_threads = len(self._executor.abandoned())
        episode.calls = list(tuner.calls)
        episode.cut = "" if tuner.expired else tuner.overflow_limit  # a timeout is its own record
        episode.seconds = time.perf_counter() - start
        if self._flagged_by_records(episode, tuner, tools, env, timeout):
            output = None
        if episode.error_source == "workflow":  # e.g. "remote": the advice then points at the remote clients
            episode.error_source = getattr(self.workflow_cls, "error_source", "workflow")
        if output is not None:
            problem = await judge_output(self.judge, self.settings.judge_timeout, episode, workflow_task, output,
                                         tuner)
            if problem is not None:
                self._log_error(episode, problem)
        if aux_models:
            episode.metrics.update(self.auxiliary.metrics(aux_models, aux_usage))  # never trained, logged apart
        apply_madness(episode, self.settings.madness_checks, self.settings.agent_madness_reward)
        if not validation:  # a validation trains nothing: its episodes are measured whole
            cuts.apply_policy(episode, self.settings.on_cut)
        return episode

    def new_tuner(self, episode_uid: str, temperature: float, step: int, timeout: float) -> ModelTuner:
        """An episode's ModelTuner, which records its LLM calls and expires `timeout` seconds from now (also each
        request's of `astuner serve-model`)."""
        return ModelTuner(
            self.engine,
            self.tokenizer,
            self.renderer,
            self.parser,
            self.settings.limits,
            temperature,
            self.stop_token_ids,
            madness_checks=self.settings.madness_checks,
            # Distinct per episode (a shared seed would make a group's episodes sample identical answers), and
            # independent of what else is in the engine's batch.
            seed=episode_seed(self.settings.seed, step, episode_uid),
            deadline=time.monotonic() + timeout,
            episode_uid=episode_uid,
            reasoning_parser=self.reasoning_parser,
            gateway=self.gateway,
            top_p=self.settings.top_p,
            top_k=self.settings.top_k,
            roster=self.roster,
        )

    def _flagged_by_records(self, episode: Episode, tuner: ModelTuner, tools: tool_failures.ToolHealth,
                            env: env_failures.EnvHealth, timeout: float) -> bool:
        """Flag the episode from the tuner's record (a timeout, an overflow), its tools' (one that could not
        start) and its environment's (a call that failed); True when flagged, and its output is then not judged.
        These records win over what the workflow returned: it may have caught our exception and gone on."""
        if env_failures.flag(episode, env):  # first: a timeout or an overflow it caused is not the model's
            self._log_error(episode, "lost its environment")
            return True
        flagged = False
        if tuner.expired:
            flagged = True
            episode.flags = [f for f in episode.flags if f != FLAG_FAILED] + [FLAG_TIMEOUT]
            reason = tuner.expired_reason or ""
            episode.error = reason if reason.startswith("episode timed out") or reason == tuner.deadline_note else \
                f"episode timed out after {timeout:g}s ({reason})"
            episode.error_summary, episode.error_source = episode.error, "workflow"
            self._log_error(episode, "timed out")
        elif tuner.overflowed:
            flagged = True
            episode.flags = [f for f in episode.flags if f != FLAG_FAILED] + [FLAG_OVERFLOW]
        if self._tool_infra_failed(episode, tools):
            flagged = True
        return flagged

    async def _execute(self, workflow_task: WorkflowTask, tuner: ModelTuner) -> WorkflowOutput:
        workflow = self.workflow_cls(config=self.config)
        result = await workflow.execute(workflow_task, tuner)
        if not isinstance(result, WorkflowOutput):
            raise TypeError(
                f"{self.workflow_cls.__name__}.execute returned {type(result).__name__}, expected WorkflowOutput"
            )
        return result

    def _tool_infra_failed(self, episode: Episode, tools: tool_failures.ToolHealth) -> bool:
        """Flag an episode whose tool could not start: its tool results were the infrastructure's errors, not the
        model's, so it is not trained on."""
        if not tools.failures:
            return False
        episode.flags = [f for f in episode.flags if f != FLAG_FAILED] + [FLAG_FAILED, FLAG_TOOL_INFRA_FAILED]
        episode.error = episode.error_summary = f"a tool could not start: {tools.failures[-1]}"
        episode.error_source = "workflow"
        self._log_error(episode, "could not run its tool")
        return True

    def _check_tool_infra(self, healths: list[tool_failures.ToolHealth]) -> None:
        """Stop the run at TOOL_INFRA_BATCHES_TO_STOP batches in a row whose tools failed to start and never
        started; a batch in which any tool started resets the count."""
        failed = [h for h in healths if h.failures]
        if any(h.started for h in healths) or not failed:
            self._tool_infra_streak = 0 if any(h.started for h in healths) else self._tool_infra_streak
            return
        self._tool_infra_streak += 1
        if self._tool_infra_streak >= TOOL_INFRA_BATCHES_TO_STOP:
            raise TrainingStalled(
                f"{self._tool_infra_streak} batches in a row could not run their tools (the sandbox did not start "
                f"in {len(failed)} episodes of the last and started in none), so they were not trained on; stopping "
                f"rather than throw every episode away. The last error: {failed[-1].failures[-1]}")

    def _log_error(self, episode: Episode, what: str) -> None:
        """Every error goes to the log file; the console gets each distinct error once, not once per episode."""
        summary = episode.error_summary or ""
        first_time = summary not in self._seen_errors
        self._seen_errors.add(summary)
        level = logging.WARNING if first_time else logging.INFO
        suffix = "" if not first_time else " (later episodes with the same error are only in the log file)"
        log.log(level, "episode %s %s%s:\n%s", episode.episode_uid, what, suffix, episode.error)


async def _await_deadline(job: WorkflowJob, tuner: ModelTuner, episode_uid: str, timeout: float) -> None:
    """Wait for the workflow until the episode's deadline (the tuner's: a workflow may move it, as a remote
    episode's starts when a client takes it); past it, expire the tuner (its pending requests are aborted), cancel
    the workflow and wait at most CANCEL_GRACE_S more, then abandon it."""
    while not job.done() and time.monotonic() < tuner.deadline:
        await asyncio.wait({job}, timeout=tuner.deadline - time.monotonic())
    if not job.done():
        tuner.expire(tuner.deadline_note or f"episode timed out after {timeout:g}s")
        job.cancel()
        done, _ = await asyncio.wait({job}, timeout=CANCEL_GRACE_S)
        if not done:
            log.warning("episode %s: the workflow ignored cancellation for %gs after its deadline; abandoned",
                        episode_uid, CANCEL_GRACE_S)


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a rollout left running on the loop (a workflow abandoned at its deadline, a judge past its
    own), waiting at most CANCEL_GRACE_S: the next step starts clean, never blocked by code that ignores
    cancellation (such code is left pending, and runs on only while a later rollout runs the loop)."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_GRACE_S))


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close the rollouts' loop at the end of the run without waiting for ever on a workflow that ignores
    cancellation."""
    try:
        _cancel_leftovers(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
