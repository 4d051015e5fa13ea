"""THE training loop. Every backbone calls `run_loop`; a backbone only decides where each stage runs
(the contract: astuner/stages.py).

    for each step (from the resumed one, if any):
        tasks    = next batch of training tasks
        chosen   = selection.gather(stages, tasks)       # stages.rollout: workflow x num_repeat, judge, madness
                                                         # (DAPO: roll out more until groups carry a signal)
        samples  = selection.learn(chosen)               # one per LLM call, GRPO advantage per episode (RFT: SFT)
        trained  = stages.train(samples, objective)      # PPO-clip step(s): TrainResult(metrics, logprobs)
        synced   = stages.sync_weights()                  # the engine samples from the new policy: a SyncReport
        log (monitor/metrics.py), validate every test_freq, checkpoint (resumable) every save_freq

The sample-selection policy (plain GRPO, DAPO dynamic sampling, RFT) is one object chosen at start
(astuner/selection.py). A backbone that rolls out ahead (trinity) is handed the next `stages.lookahead` batches
early; every episode carries the policy version that generated it, and the step logs its staleness.

A Ray worker lost mid-run (WorkerLost) stops the run; if the trainer still holds the last completed step, that
step is checkpointed first, so a resume continues from it.

Never silently idle: a step whose episodes all failed or timed out stops the run, and so do `max_idle_steps`
steps in a row without a sample that carries a gradient (no episode trained, or every group's rewards equal),
with a message quoting the first error seen.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from astuner.algorithm.catalog import algorithm
from astuner.errors import WorkerLost
from astuner.selection import SelectionSettings, choose_selection
from astuner.stages import Stages
from astuner.types import Episode, Sample, Task, TrainResult
from astuner.watchdog import Watchdog

log = logging.getLogger(__name__)


class MonitorLike(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def save_episodes(self, step: int, episodes: list[Episode], tag: str,
                      samples: list[Sample] | None = None) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class LoopSettings:
    """The run's schedule; what a step trains on is the selection policy's (`selection`, selection.py)."""

    train_batch_size: int
    total_epochs: int
    total_training_steps: int | None
    save_freq: int
    test_freq: int
    val_before_train: bool
    shuffle: bool
    seed: int
    selection: SelectionSettings
    val_num_repeat: int = 1
    watchdog_factor: float = 3.0  # a step slower than this many median steps is reported (astuner/watchdog.py)
    stage_timeout_s: float | None = None  # a stage running longer stops the run (None: no deadline)

    @classmethod
    def from_config(cls, typed) -> "LoopSettings":
        a, tc = typed.astuner, typed.astuner.trainer_common
        return cls(
            train_batch_size=a.data.train_batch_size,
            total_epochs=tc.total_epochs,
            total_training_steps=tc.total_training_steps,
            save_freq=tc.save_freq,
            test_freq=tc.test_freq,
            val_before_train=tc.val_before_train,
            shuffle=a.data.shuffle,
            seed=a.seed,
            selection=SelectionSettings.from_config(typed),
            val_num_repeat=tc.val_num_repeat,
            watchdog_factor=tc.watchdog_factor,
            stage_timeout_s=tc.stage_timeout_s,
        )


@dataclass
class ResumeState:
    """Where a run stands after a step; saved with each checkpoint, plain JSON."""

    step: int = 0
    epoch: int = 0  # epoch of the next batch
    position: int = 0  # index of the next task in that epoch's (shuffled) order
    idle_steps: int = 0
    val_scores: dict[str, float] = field(default_factory=dict)
    first_error: str | None = None
    first_error_source: str = "workflow"  # the part that failed: a key of selection.FIX_ADVICE


@dataclass
class RunSummary:
    steps: int = 0
    seconds: float = 0.0
    val_scores: dict[int, float] = field(default_factory=dict)  # step -> validation score
    last_checkpoint: Path | None = None
    score_name: str = "accuracy"  # or "loss" (offline objectives)
    warnings: list[str] = field(default_factory=list)  # what still held at the last step (tools never used)
    void_validations: list[int] = field(default_factory=list)  # steps whose validation measured nothing

    def line(self, name: str) -> str:
        """The run in one line, then each standing warning on its own line (a reader of the end sees both)."""
        minutes, seconds = divmod(int(self.seconds), 60)
        text = f"{name}: {self.steps} steps in {minutes}m{seconds:02d}s"
        if self.val_scores:
            first, last = min(self.val_scores), max(self.val_scores)
            start, end = self.val_scores[first], self.val_scores[last]
            digits = 3 if self.score_name == "accuracy" else 4
            text += (f"; validation {self.score_name} {start:.{digits}f} (step {first}) -> {end:.{digits}f} "
                     f"(step {last}), {end - start:+.{digits}f}")
        if self.void_validations:
            steps = ", ".join(map(str, self.void_validations))
            text += f"; validation void (n/a) at step{'s' if len(self.void_validations) > 1 else ''} {steps}"
        if self.last_checkpoint is not None:
            text += f"; checkpoint {self.last_checkpoint}"
        return "\n".join([text] + [f"warning: {w}" for w in self.warnings])


def count_steps(num_tasks: int, settings: LoopSettings) -> int:
    total = math.ceil(num_tasks / settings.train_batch_size) * settings.total_epochs
    if settings.total_training_steps is not None:
        total = min(total, settings.total_training_steps)
    return total


def task_batches(
    tasks: list[Task], settings: LoopSettings, epoch: int = 0, position: int = 0
) -> Iterator[tuple[list[Task], int, int]]:
    """(batch, epoch, position after it) over epochs of (optionally shuffled) tasks, from (epoch, position).

    Epoch e's order is the e-th shuffle of one seeded generator, so a resumed run sees the same order; the last
    batch of an epoch may be smaller.
    """
    rng = random.Random(settings.seed)
    for e in range(settings.total_epochs):
        order = list(tasks)
        if settings.shuffle:
            rng.shuffle(order)
        if e < epoch:
            continue
        start = position if e == epoch else 0
        for begin in range(start, len(order), settings.train_batch_size):
            end = begin + settings.train_batch_size
            yield order[begin:end], e, min(end, len(order))


def run_loop(
    settings: LoopSettings,
    stages: Stages,
    train_tasks: list[Task],
    val_tasks: list[Task],
    monitor: MonitorLike,
    resume: ResumeState | None = None,
    on_slow=None,
    progress=None,
) -> RunSummary:
    """`on_slow(line)`: shows the watchdog's line on the progress bar when a step runs slow; `progress`:
    (description, total) -> a bar with update(), handed to the stages' rollouts (stages.py)."""
    state = resume or ResumeState()
    summary = RunSummary(steps=state.step, val_scores={int(k): v for k, v in state.val_scores.items()},
                         score_name=stages.score_name)
    watchdog = Watchdog(settings.watchdog_factor, deadline_s=settings.stage_timeout_s, on_slow=on_slow)
    run = _Run(settings, stages, monitor, state, summary, val_tasks, count_steps(len(train_tasks), settings),
               watchdog, progress)
    started = time.perf_counter()
    batches = _Peekable(task_batches(train_tasks, settings, state.epoch, state.position))
    try:
        with watchdog:
            if settings.val_before_train and state.step == 0:
                run.validate(0)
            for step, (tasks, epoch, position) in enumerate(batches, start=state.step + 1):
                if step > run.total_steps:
                    break
                run.step(step, tasks, batches, epoch, position)
    except WorkerLost as exc:
        log.error("%s", exc)  # in the run's log too: a background run's console may be nobody's
        # Checkpoint the last completed step if the trainer still holds exactly it, so a resume continues there.
        if exc.trainer_ok and state.step > run.saved_step and not run.trainer_ahead:
            try:
                summary.last_checkpoint = stages.save_checkpoint(state.step, asdict(state))
                log.error("saved the last completed step as %s before stopping", summary.last_checkpoint)
            except Exception as save_exc:  # the trainer went too: the previous checkpoint stays the last one
                log.error("could not save step %d as well (%s)", state.step, save_exc)
        raise
    summary.seconds = time.perf_counter() - started
    return summary


class _Peekable:
    """An iterator whose next items can be looked at without taking them."""

    def __init__(self, it) -> None:
        self._it, self._ahead = it, collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        return self._ahead.popleft() if self._ahead else next(self._it)

    def peek(self, n: int) -> list:
        while len(self._ahead) < n:
            try:
                self._ahead.append(next(self._it))
            except StopIteration:
                break
        return list(self._ahead)[:n]


class _Run:
    """One run's step, validation and checkpoint; what they share lives here."""

    def __init__(self, settings, stages, monitor, state, summary, val_tasks, total_steps, watchdog,
                 progress=None) -> None:
        self.settings, self.stages, self.monitor, self.watchdog = settings, stages, monitor, watchdog
        self.progress = progress
        self.state, self.summary, self.val_tasks, self.total_steps = state, summary, val_tasks, total_steps
        self.selection = choose_selection(settings.selection)
        self.saved_step = state.step  # the last step with a checkpoint (or the resumed one)
        self.trainer_ahead = False  # the trainer has taken a step that `state` does not record yet

    def step(self, step: int, tasks: list[Task], batches: _Peekable, epoch: int, position: int) -> None:
        stages, state, watchdog = self.stages, self.state, self.watchdog
        for i, (upcoming, _, _) in enumerate(batches.peek(stages.lookahead), start=1):
            if step + i <= self.total_steps:
                stages.prefetch(step + i, upcoming)
        watchdog.step_started(step)
        t0 = time.perf_counter()
        with watchdog.stage("rollout"):
            chosen = self.selection.gather(stages, tasks, batches, step, epoch, position, self.progress)
        t1 = time.perf_counter()
        samples, learned = self.selection.learn(chosen, state, step)
        with watchdog.stage("train"):
            trained = stages.train(samples, self.selection.objective) if samples else TrainResult({}, [])
        trained.attach_to(samples)  # the trainer's logprobs before the update, for the log viewer
        train_metrics = trained.metrics
        t2 = time.perf_counter()
        # From here until the state records this step, the trainer holds a step the run state lacks.
        self.trainer_ahead = True
        with watchdog.stage("sync"):
            synced = stages.sync_weights()
        seconds = {"rollout": t1 - t0, "train": t2 - t1, "sync": time.perf_counter() - t2}
        sync_metrics = synced.metrics() if synced is not None else {}
        metrics = self.selection.report(step, chosen, samples, train_metrics, seconds,
                                        {**sync_metrics, **stages.step_metrics(), **chosen.metrics, **learned})
        self.monitor.log_metrics(step, metrics)
        if chosen.episodes:
            self.monitor.save_episodes(step, chosen.episodes, "train", samples)
        self.summary.steps, self.summary.warnings = step, self.selection.standing_warnings()
        state.step, state.epoch, state.position = step, chosen.epoch, chosen.position
        self.trainer_ahead = False
        self.selection.check_idle(state, chosen, samples, step)
        watchdog.step_finished()  # the median step: rollout to sync (validation and checkpoints are occasional)
        if step % self.settings.test_freq == 0 or step == self.total_steps:
            self.validate(step)
        if step % self.settings.save_freq == 0 or step == self.total_steps:
            with watchdog.stage("checkpoint"):
                self.summary.last_checkpoint = stages.save_checkpoint(step, asdict(state))
            self.saved_step = step
        self.monitor.step_done(step, metrics)

    def validate(self, step: int) -> None:
        if not self.val_tasks:
            return
        t0 = time.perf_counter()
        with self.watchdog.stage("validation"):
            result = self.stages.validate(self.val_tasks, step, self.settings.val_num_repeat, self.progress)
        metrics = {**result.metrics, "time/validation_s": time.perf_counter() - t0}
        if result.void:  # a score of 0 here would read as a measured model: none is recorded
            self.summary.void_validations.append(step)
        else:
            self.summary.val_scores[step] = self.state.val_scores[str(step)] = result.score
        self.monitor.log_metrics(step, metrics)
        if result.episodes:
            self.monitor.save_episodes(step, result.episodes, "val")
        if result.void:
            log.warning(f"validation void at step {step}: {result.void}; its {result.score_name} is n/a (no "
                        "measurement). Fix what stopped the episodes (astuner.log names each), then validate again.")
            return
        digits = 3 if result.score_name == "accuracy" else 4
        log.info(f"step {step} validation {result.score_name} {result.score:.{digits}f} over {len(self.val_tasks)} "
                 "tasks")


def drive(loaded, settings: LoopSettings, stages: Stages, train_tasks: list, val_tasks: list, total_steps: int,
          tokenizer, checkpoint: Path | None = None, vllm_engines_here: int = 0) -> RunSummary:
    """What every backbone does around the loop: resume from `checkpoint` (the trainer's state, then the engines'
    weights), open the monitor, run the loop, release the stages and print the summary line. `vllm_engines_here`:
    the vLLM engines running in this process, beside which a distillation teacher's takes its part of the GPU."""
    from astuner.logs import announce
    from astuner.monitor import Monitor

    monitor = None
    try:
        if algorithm(loaded.typed.astuner.trainer_common.algorithm.type).has_teacher:
            from astuner.distill import build_teacher
            from astuner.engine.build import build_engine

            stages.teacher = build_teacher(loaded.typed, tokenizer, build_engine, vllm_engines_here)
        resume = None
        if checkpoint is not None:
            resume = ResumeState(**stages.load_checkpoint(checkpoint))
            stages.resumed(resume.step)
            announce(f"resumed at step {resume.step} of {total_steps} from {checkpoint}")
        monitor = Monitor(loaded.experiment_dir, total_steps, tokenizer=tokenizer,
                          resume_step=None if resume is None else resume.step)
        summary = run_loop(settings, stages, train_tasks, val_tasks, monitor, resume=resume,
                           on_slow=monitor.show_stall, progress=monitor.episode_bar)
    finally:
        if monitor is not None:
            monitor.close()
        stages.shutdown()
        if stages.teacher is not None:
            stages.teacher.shutdown()
    line = summary.line(loaded.typed.astuner.project_name)
    log.info(line)
    print(line, flush=True)
    return summary
