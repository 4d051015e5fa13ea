"""The judge interface, and the lookups the built-in judges share.

A judge scores an episode when the workflow returned `reward=None`. It is named in the config by
`astuner.task_judge.judge_protocol: "pkg.module->Class"` and built once per run as `Class(config)`.
The rollout may call `compute_reward` from worker threads, so a judge must not rely on signals.

A plain (sync) `compute_reward` runs in a daemon thread of its own (`call_judge`), so that a slow judge does not
stall the episodes still running and a hung one can be left behind: the rollout gives judging a deadline
(astuner.task_judge.timeout) and a thread cannot be killed, so past the deadline its thread is abandoned, still
running, and nothing waits for it (not the rollout, not interpreter exit). An async judge is cancelled instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

from astuner.errors import UserError
from astuner.workflow import WorkflowOutput, WorkflowTask

# Where the built-in judges look for the ground truth in `Task.metadata`, first present wins.
GROUND_TRUTH_KEYS = ("answer", "ground_truth", "solution")
# Where they look for the prediction in `WorkflowOutput.metadata`.
FINAL_ANSWER_KEY = "final_answer"


class BaseJudge(ABC):
    """Subclass and implement `compute_reward`. `config` is the whole run config (None in some tests)."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    @abstractmethod
    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        """Return (reward, is_success) for one episode."""


class FunctionJudge(BaseJudge):
    """A judge written as `async def judge(task: dict, response, auxiliary_models) -> JudgeOutput` (or a plain
    def, run in a worker thread); `response` is the workflow's `WorkflowOutput.response`."""

    def __init__(self, fn, config: Any = None) -> None:
        super().__init__(config)
        self.fn = fn

    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        from astuner.workflow import JudgeOutput, task_dict

        args = (task_dict(workflow_task.task), workflow_output.response, workflow_task.auxiliary_models)
        result = await call_judge(self.fn, *args)
        if not isinstance(result, JudgeOutput):
            raise UserError(f"judge function {getattr(self.fn, '__qualname__', self.fn)!r} returned "
                            f"{type(result).__name__}; it must return JudgeOutput(reward=...)")
        workflow_output.metrics.update(result.metrics)
        success = result.is_success if result.is_success is not None else result.reward > 0
        return float(result.reward), bool(success)


async def call_judge(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`: awaited if `fn` is a coroutine function, else run in a daemon thread of its own."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await in_daemon_thread(fn, *args)


async def in_daemon_thread(fn: Callable, *args: Any) -> Any:
    """Like `asyncio.to_thread`, but in a new daemon thread rather than the loop's executor, whose threads are
    joined when the loop closes and at interpreter exit: a call that never returns must not hang either.
    Cancelling the await abandons the thread (its result, when it comes, is dropped)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled: nobody waits any more
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, context.run(fn, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: abandoned long ago

    threading.Thread(target=work, name=f"judge:{getattr(fn, '__qualname__', fn)}", daemon=True).start()
    return await future


def final_answer_of(workflow_output: WorkflowOutput) -> str | None:
    """`workflow_output.metadata["final_answer"]` as stripped text; None when missing or empty."""
    value = (workflow_output.metadata or {}).get(FINAL_ANSWER_KEY)
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def ground_truth_of(workflow_task: WorkflowTask) -> str:
    """The first non-empty of GROUND_TRUTH_KEYS in the task's metadata, as text.

    A GSM8K answer ("...reasoning...\\n#### 72") is reduced to the text after the last "####".
    """
    metadata = workflow_task.task.metadata or {}
    for key in GROUND_TRUTH_KEYS:
        value = metadata.get(key)
        if value is None or not str(value).strip():
            continue
        text = str(value).strip()
        if "####" in text:
            text = text.rsplit("####", 1)[1].strip()
        if text:
            return text
    raise UserError(
        f"task {workflow_task.task.task_id!r}: no ground truth for the judge; it looks for the first of "
        f"{', '.join(GROUND_TRUTH_KEYS)} in the dataset row, and the row has fields: "
        f"{', '.join(map(str, metadata)) or '(none)'}."
    )
