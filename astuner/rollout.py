"""Rollout: run the user's workflow `num_repeat` times per task, concurrently, and turn each run into an Episode.

Per episode: a fresh Workflow instance and a fresh ModelTuner (which records every LLM call), a timeout, and
never a crash of the run: an exception or timeout is logged with its traceback and the episode is flagged
(failed / timeout) and left out of training. A context overflow ends the episode early (flag "overflow",
reward 0.0, its calls are kept). When the workflow returns reward=None the judge scores it. If a madness check
listed in `rollout.compute_madness_checklist` fired on any call, the reward becomes `agent_madness_reward`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from astuner.engine.base import InferenceEngine
from astuner.errors import UserError
from astuner.model_tuner import EpisodeOverflow, ModelTuner, TunerLimits
from astuner.model_tuner.chat_format import ChatRenderer
from astuner.model_tuner.tool_parser import TOOL_PARSERS
from astuner.task_judge.base_judge import BaseJudge
from astuner.types import FLAG_FAILED, FLAG_OVERFLOW, FLAG_TIMEOUT, Episode, Task
from astuner.workflow import WorkflowOutput, WorkflowTask

log = logging.getLogger(__name__)


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
    tool_parser: str

    @classmethod
    def from_config(cls, cfg) -> "RolloutSettings":
        r, d = cfg.astuner.rollout, cfg.astuner.data
        return cls(
            num_repeat=int(r.num_repeat),
            max_env_worker=int(r.max_env_worker),
            temperature=float(r.temperature),
            episode_timeout=float(r.episode_timeout),
            agent_madness_reward=float(r.agent_madness_reward),
            madness_checks=tuple(r.compute_madness_checklist),
            limits=TunerLimits(
                max_model_len=int(r.max_model_len),
                max_tokens_per_turn=int(r.max_response_length_in_one_turn),
                max_response_tokens=int(d.max_response_length),
                max_prompt_length=int(d.max_prompt_length),
            ),
            tool_prompt=str(r.tool_prompt),
            tool_parser=str(r.tool_parser),
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
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.workflow_cls = workflow_cls
        self.judge = judge
        self.stop_token_ids = stop_token_ids
        self.config = config
        self._seen_errors: set[str] = set()
        self.renderer = ChatRenderer(tokenizer, settings.tool_prompt)
        self.parser = TOOL_PARSERS[settings.tool_parser]()

    def run(
        self,
        tasks: list[Task],
        *,
        validation: bool = False,
        on_episode_done: Callable[[Episode], None] | None = None,
    ) -> list[Episode]:
        """Training: `num_repeat` sampled episodes per task. Validation: one greedy episode per task."""
        return asyncio.run(self.run_async(tasks, validation=validation, on_episode_done=on_episode_done))

    async def run_async(self, tasks, *, validation=False, on_episode_done=None) -> list[Episode]:
        repeats = 1 if validation else self.settings.num_repeat
        temperature = 0.0 if validation else self.settings.temperature
        gate = asyncio.Semaphore(self.settings.max_env_worker)

        async def one(task: Task, index: int) -> Episode:
            async with gate:
                episode = await self._episode(task, index, temperature, validation)
            if on_episode_done is not None:
                on_episode_done(episode)
            return episode

        jobs = [one(task, i) for task in tasks for i in range(repeats)]
        return list(await asyncio.gather(*jobs))

    async def _episode(self, task: Task, repeat_index: int, temperature: float, validation: bool) -> Episode:
        tag = "val" if validation else "train"
        episode = Episode(task=task, repeat_index=repeat_index, episode_uid=f"{tag}:{task.task_id}#{repeat_index}")
        tuner = ModelTuner(
            self.engine,
            self.tokenizer,
            self.renderer,
            self.parser,
            self.settings.limits,
            temperature,
            self.stop_token_ids,
            madness_checks=self.settings.madness_checks,
            # No per-request seed: a shared one would make the episodes of a group sample identical answers
            # on an engine that honours it. Reproducibility comes from the engine's own seeded generator.
            seed=None,
        )
        workflow_task = WorkflowTask(task, repeat_index, episode.episode_uid, validation)
        start = time.perf_counter()
        output: WorkflowOutput | None = None
        try:
            workflow = self.workflow_cls(config=self.config)
            result = await asyncio.wait_for(workflow.execute(workflow_task, tuner), self.settings.episode_timeout)
            if not isinstance(result, WorkflowOutput):
                raise TypeError(f"{self.workflow_cls.__name__}.execute returned {type(result).__name__}, "
                                "expected WorkflowOutput")
            output = result
        except EpisodeOverflow:
            episode.flags.append(FLAG_OVERFLOW)
        except asyncio.TimeoutError:
            episode.flags.append(FLAG_TIMEOUT)
            episode.error = f"episode timed out after {self.settings.episode_timeout:.0f}s"
            self._log_error(episode, "timed out")
        except UserError:
            raise  # bad input (e.g. a dataset without the field the judge needs) stops the run with its message
        except Exception:
            episode.flags.append(FLAG_FAILED)
            episode.error = traceback.format_exc()
            self._log_error(episode, "failed")
        episode.calls = list(tuner.calls)
        episode.seconds = time.perf_counter() - start

        if output is not None:
            episode.output_metadata = dict(output.metadata)
            try:
                self._score(episode, workflow_task, output)
            except UserError:
                raise
            except Exception:
                episode.flags.append(FLAG_FAILED)
                episode.error = traceback.format_exc()
                self._log_error(episode, "could not be judged")
        self._apply_madness(episode)
        return episode

    def _log_error(self, episode: Episode, what: str) -> None:
        """Every error goes to the log file; the console gets each distinct error once, not once per episode."""
        last_line = (episode.error or "").strip().splitlines()[-1:] or [""]
        first_time = last_line[0] not in self._seen_errors
        self._seen_errors.add(last_line[0])
        level = logging.WARNING if first_time else logging.INFO
        suffix = "" if not first_time else " (later episodes with the same error are only in the log file)"
        log.log(level, "episode %s %s%s:\n%s", episode.episode_uid, what, suffix, episode.error)

    def _score(self, episode: Episode, workflow_task: WorkflowTask, output: WorkflowOutput) -> None:
        if output.reward is None:
            reward, success = self.judge.compute_reward(workflow_task, output)
        else:
            reward = output.reward
            success = output.is_success if output.is_success is not None else reward > 0
        episode.reward = float(reward)
        episode.is_success = bool(success)

    def _apply_madness(self, episode: Episode) -> None:
        fired = sorted({f for call in episode.calls for f in call.flags if f in self.settings.madness_checks})
        if fired:
            episode.flags.extend(fired)
            episode.reward = self.settings.agent_madness_reward
            episode.is_success = False
