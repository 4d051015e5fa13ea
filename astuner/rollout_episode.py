"""The steps of one episode that hold no state of the runner's (astuner/rollout.py runs them, and its docstring
says why): the workflow's task, which records who cancelled it, and what it returned; the episode's sampling seed;
the judging of that output, within the judge deadline; the madness penalty. A step that flags the episode returns
what happened, for the runner's log."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import sys
import time
import traceback
from typing import Any

from astuner.auxiliary import judging_deadline
from astuner.environments.failures import EnvironmentFailure
from astuner.errors import UserError
from astuner.model_tuner import EpisodeOverflow, EpisodeTimeout, ModelTuner
from astuner.task_judge.base_judge import BaseJudge, call_judge
from astuner.types import FLAG_ENV_FAILED, FLAG_FAILED, FLAG_JUDGE_TIMEOUT, Episode
from astuner.watchdog import watch
from astuner.workflow import WorkflowOutput, WorkflowTask


class JudgeTimeout(Exception):
    """The episode's judges did not answer within task_judge.timeout."""


def describe_exception(exc: BaseException) -> str:
    """The exception in its own words, "Type: message", then its notes (PEP 678: LangGraph adds "During task
    with name ..."), which a traceback prints after the message and so would otherwise stand in for it."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text + "".join(f" [note: {note}]" for note in getattr(exc, "__notes__", None) or [])


# --- the workflow's task ------------------------------------------------------------------------------------

# Packages whose primitives cancel a task and take their own request back (timeouts, task groups, cancel scopes):
# a cancellation count they leave is bookkeeping, not a cancellation the workflow swallowed. CPython 3.11's
# TaskGroup never takes back the one it sends when a child fails while the parent waits in its exit, so a workflow
# that catches that child's error with `except*` ends with `cancelling() == 1` and nothing cancelled.
_SELF_CANCELLING = ("asyncio", "anyio")


class WorkflowJob(asyncio.Task):
    """The workflow's task; it records the module of each caller of `cancel`, so that the rollout can tell who
    cancelled it (an AgentScope interrupt is `agentscope.agent._agent_base`)."""

    def __init__(self, coro, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.cancellers: list[str] = []
        super().__init__(coro, loop=loop)

    def cancel(self, msg: Any = None) -> bool:
        self.cancellers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return super().cancel(msg)


def cancelled_from_inside(job: WorkflowJob) -> str | None:
    """Who cancelled the workflow's task, when it ended cancelled, or when it returned with a cancellation still
    counted (`Task.cancelling`) that code outside `_SELF_CANCELLING` sent: one the workflow or its framework
    swallowed. None otherwise. The rollout's own cancellation, past the deadline, is told apart by the expired
    tuner."""
    if not job.done():
        return None
    foreign = list(dict.fromkeys(m for m in job.cancellers if m.partition(".")[0] not in _SELF_CANCELLING))
    if job.cancelled():
        return ", ".join(foreign or dict.fromkeys(job.cancellers)) or "its own code or its framework"
    if foreign and getattr(job, "cancelling", lambda: 1)() > 0:  # no Task.cancelling before 3.11: any foreign one
        return ", ".join(foreign)
    return None


def workflow_output(episode: Episode, job: WorkflowJob,
                    tuner: ModelTuner) -> tuple[WorkflowOutput | None, str | None]:
    """What the workflow returned, or None; the episode is flagged failed when the workflow raised, or was
    cancelled by anything but astuner's deadline (astuner/rollout.py's docstring): then what happened, for the log,
    else None."""
    output: WorkflowOutput | None = None
    problem = None
    try:
        if job.done() and not job.cancelled():
            output = job.result()
    except UserError:
        raise  # bad input (e.g. a dataset without the field the judge needs) stops the run with its message
    except (EpisodeOverflow, EpisodeTimeout):
        pass  # flagged by the rollout from the tuner's own record
    except Exception as exc:
        episode.flags.append(FLAG_FAILED)
        episode.error = traceback.format_exc()
        episode.error_summary = f"the workflow raised {describe_exception(exc)}"
        episode.error_source = "workflow"
        problem = "failed"
    cancelled_by = None if tuner.expired or FLAG_FAILED in episode.flags else cancelled_from_inside(job)
    if cancelled_by is not None:
        output = None
        episode.flags.append(FLAG_FAILED)
        episode.error = episode.error_summary = (
            f"the workflow was cancelled, not by astuner's deadline but by {cancelled_by} (an AgentScope "
            "agent's interrupt() cancels the task awaiting it, and AgentBase.__call__ then answers "
            "'interrupted' instead of raising); not trained on as a zero. To stop an agent on purpose, run it "
            "in a task of its own (asyncio.create_task) and let the workflow return its reward")
        episode.error_source = "workflow"
        problem = "was cancelled"
    return output, problem


def episode_seed(seed: int, step: int, episode_uid: str) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{episode_uid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# --- judging ------------------------------------------------------------------------------------------------


async def judge_output(judge: BaseJudge, timeout: float, episode: Episode, workflow_task: WorkflowTask,
                       output: WorkflowOutput, tuner: ModelTuner) -> str | None:
    """Score what the workflow returned into the episode, with its metadata and metrics. A judge that raised or
    did not answer within `timeout` flags the episode failed; then what happened, for the log, else None."""
    episode.output_metadata = dict(output.metadata)
    output.stats = {"calls": len(tuner.calls), "response_tokens": tuner.generated_tokens,
                    "summary_tokens": sum(len(c.response_ids) for c in tuner.calls if c.context == "summary")}
    try:
        await score(judge, timeout, episode, workflow_task, output)
        episode.output_metadata = dict(output.metadata)  # a judge may add to it (EnvServiceJudge)
        episode.metrics = {k: float(v) for k, v in output.metrics.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
        episode.agent_rewards = agent_rewards(output.agent_rewards)
    except UserError:
        raise
    except JudgeTimeout as exc:
        episode.flags += [FLAG_FAILED, FLAG_JUDGE_TIMEOUT]
        episode.error = episode.error_summary = str(exc)
        episode.error_source = "judge"
        return "was not judged in time"
    except EnvironmentFailure as exc:  # the environment's scorer failed: retried as any failed environment
        episode.flags += [FLAG_FAILED, FLAG_ENV_FAILED]
        episode.error = traceback.format_exc()
        episode.error_summary, episode.error_source = str(exc), "environment"
        return "lost its environment"
    except Exception as exc:
        episode.flags.append(FLAG_FAILED)
        episode.error = traceback.format_exc()
        episode.error_summary = f"judge {type(judge).__qualname__} raised {describe_exception(exc)}"
        episode.error_source = "judge"
        return "could not be judged"
    return None


def agent_rewards(given) -> dict[str, float]:
    """WorkflowOutput.agent_rewards as {agent: float}; anything else is the workflow's mistake, said plainly."""
    if not isinstance(given, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in given.items()):
        raise UserError(f"WorkflowOutput.agent_rewards must map agent names to numbers, got {given!r:.200}")
    return {k: float(v) for k, v in given.items()}


async def score(judge: BaseJudge, timeout: float, episode: Episode, workflow_task: WorkflowTask,
                output: WorkflowOutput) -> None:
    """The episode's reward and success: the workflow's own, or, when its reward is None, the judge's."""
    if output.reward is None:
        with watch("judge", type(judge).__qualname__):
            result = await judge_within_deadline(judge, timeout, workflow_task, output)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (int, float))
                and not isinstance(result[0], bool)):
            raise UserError(
                f"judge {type(judge).__qualname__}.compute_reward returned {result!r:.200}; it must return "
                "(reward: float, is_success: bool)."
            )
        reward, success = result
    else:
        reward = output.reward
        success = output.is_success if output.is_success is not None else reward > 0
    episode.reward = float(reward)
    episode.is_success = bool(success)


async def judge_within_deadline(judge: BaseJudge, timeout: float, workflow_task: WorkflowTask,
                                output: WorkflowOutput):
    """The judge's answer within `timeout` (task_judge.timeout: astuner/rollout.py's docstring), else
    JudgeTimeout. A sync judge runs in a daemon thread: a slow one (a verifier, a sandbox, a remote model) must not
    stall the episodes still running on this event loop, and a hung one is left behind."""
    # A judge's calls to auxiliary models served by astuner have the judge's deadline, not the episode's
    # (which a long but successful episode may have all but used up).
    judging_deadline(workflow_task.auxiliary_models, time.monotonic() + timeout)
    job = asyncio.ensure_future(call_judge(judge.compute_reward, workflow_task, output))
    done, _ = await asyncio.wait({job}, timeout=timeout)
    if not done:
        job.cancel()  # not awaited: a judge that ignores cancellation is cancelled again at loop close
        sync = not inspect.iscoroutinefunction(judge.compute_reward)
        raise JudgeTimeout(
            f"judge {type(judge).__qualname__} did not answer within {timeout:g}s "
            "(astuner.task_judge.timeout); " + ("its worker thread is abandoned, still running" if sync
                                                else "it was cancelled"))
    return job.result()


def apply_madness(episode: Episode, madness_checks: tuple[str, ...], agent_madness_reward: float) -> None:
    """The madness checks of `madness_checks` that fired on any call flag the episode, whose reward becomes
    `agent_madness_reward`."""
    fired = sorted({f for call in episode.calls for f in call.flags if f in madness_checks})
    if fired:
        episode.flags.extend(fired)
        episode.reward = agent_madness_reward
        episode.is_success = False
