"""Run outputs: log file, tensorboard scalars, metrics.jsonl, saved trajectories, console progress.

Logging goes through loguru: a file sink (<experiment_dir>/astuner.log, INFO and up) and a console sink (WARNING and
up, written with tqdm.write so the progress bars stay whole). Records of the standard `logging` module (astuner's
own modules, libraries) are routed into loguru, and a workflow that does `from loguru import logger` logs into
the same file.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from astuner.types import Episode

log = logging.getLogger(__name__)

# Shown on the progress bar, in this order, when present.
_POSTFIX = {
    "train/reward_mean": "reward",
    "train/success_rate": "success",
    "val/accuracy": "val_acc",
    "actor/policy_loss": "loss",
    "perf/rollout_tokens_per_s": "gen_tok/s",
}


_SINKS: list[int] = []  # loguru sink ids added by setup_logging, removed on the next call
_LOG_PATH: list[Path] = []  # the run's log file, once setup_logging ran in this process
# Libraries whose warnings go to the log file only (their errors still reach the console): vLLM explains its own
# start-up choices at length, none of which a user acts on.
_FILE_ONLY = ("vllm", "triton")


def run_log_path() -> Path | None:
    """The run's log file in this process (None before setup_logging: a bench or a test using an engine alone)."""
    return _LOG_PATH[-1] if _LOG_PATH else None


def _for_console(record) -> bool:
    name = record["name"] or ""
    return record["level"].no >= 40 or not name.split(".")[0] in _FILE_ONLY


def setup_logging(experiment_dir: Path) -> Path:
    """Log INFO and above to <experiment_dir>/astuner.log; the console shows warnings and the progress bar."""
    from loguru import logger

    experiment_dir.mkdir(parents=True, exist_ok=True)
    path = experiment_dir / "astuner.log"
    for sink in _SINKS:
        logger.remove(sink)
    _SINKS.clear()
    try:
        logger.remove(0)  # loguru's own default stderr sink would print every INFO line a second time
    except ValueError:
        pass
    _SINKS.append(logger.add(path, level="INFO", encoding="utf-8", enqueue=False,
                             format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} {name}: {message}"))
    _SINKS.append(logger.add(_console, level="WARNING", format="astuner: {level}: {message}", colorize=False,
                             filter=_for_console))
    _LOG_PATH[:] = [path]
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        if isinstance(handler, _InterceptHandler):
            root.removeHandler(handler)
    root.addHandler(_InterceptHandler())
    return path


def announce(message: str) -> None:
    """INFO in the log file, and on the console whatever its level filter."""
    from loguru import logger
    from tqdm import tqdm

    logger.info(message)
    tqdm.write(f"astuner: {message}", file=sys.stderr)


def _console(message) -> None:
    from tqdm import tqdm

    tqdm.write(str(message).rstrip("\n"), file=sys.stderr)


class _InterceptHandler(logging.Handler):
    """Standard logging -> loguru, keeping the record's level and logger name."""

    def emit(self, record: logging.LogRecord) -> None:
        from loguru import logger

        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        text = record.getMessage()
        if record.exc_info:
            import traceback

            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        logger.patch(lambda r: r.update(name=record.name)).log(level, text)


class Monitor:
    def __init__(
        self,
        experiment_dir: Path,
        total_steps: int,
        tokenizer=None,
        show_progress: bool = True,
        resume_step: int | None = None,
    ) -> None:
        """`resume_step`: the run continues after that step; metrics and tensorboard events of later steps (the
        part of the earlier run after its checkpoint) are dropped, so nothing is counted twice."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.dir = experiment_dir
        self.tokenizer = tokenizer
        metrics_path = experiment_dir / "metrics.jsonl"
        if resume_step is not None:
            _truncate_metrics(metrics_path, resume_step)
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(experiment_dir / "tensorboard"), purge_step=purge)
        self.metrics_file = open(metrics_path, "a" if resume_step is not None else "w", encoding="utf-8")
        self.trajectory_dir = experiment_dir / "trajectories"
        self.trajectory_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _drop_later_trajectories(self.trajectory_dir, resume_step)
        from astuner.logview.store import StepWriter

        self.store = StepWriter(experiment_dir, resume_step)  # the log viewer's data, one transaction per step
        self.bar = tqdm(total=total_steps, desc="astuner", unit="step", disable=not show_progress, dynamic_ncols=True,
                        initial=resume_step or 0)
        self._postfix: dict[str, str] = {}

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        log.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        for key, short in _POSTFIX.items():
            if key in metrics:
                self._postfix[short] = f"{metrics[key]:.3g}"
        self.bar.set_postfix(self._postfix, refresh=True)

    def save_episodes(self, step: int, episodes: list[Episode], tag: str, samples=None) -> None:
        """trajectories/<tag>_step_N.jsonl (text), and the log viewer's store (token level, with what was
        trained: `samples` after the train step, carrying the trainer's logprobs)."""
        from astuner.logview.records import episode_records

        path = self.trajectory_dir / f"{tag}_step_{step:06d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for episode in episodes:
                f.write(json.dumps(self._episode_record(episode), ensure_ascii=False, default=str) + "\n")
        self.store.write(tag, step, episode_records(episodes, samples, self.tokenizer))

    def episode_bar(self, description: str, total: int):
        """A second, transient bar under the step bar: episodes finished in the current rollout."""
        from tqdm import tqdm

        return tqdm(total=total, desc=f"  {description}", unit="episode", leave=False, position=1,
                    disable=self.bar.disable, dynamic_ncols=True)

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        self._postfix.pop("slow", None)
        self.bar.update(1)

    def show_stall(self, line: str) -> None:
        """The watchdog's line (astuner/watchdog.py) on the step bar until the step ends."""
        self._postfix["slow"] = line
        self.bar.set_postfix(self._postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.metrics_file.close()
        self.store.close()

    def _episode_record(self, episode: Episode) -> dict:
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids, **_: "")
        return {
            "episode_uid": episode.episode_uid,
            "task_id": episode.task.task_id,
            "query": episode.task.main_query,
            "reward": episode.reward,
            "is_success": episode.is_success,
            "flags": episode.flags,
            "error": episode.error,
            "error_summary": episode.error_summary,
            "seconds": round(episode.seconds, 3),
            "policy_version": episode.policy_version,
            "output_metadata": episode.output_metadata,
            "calls": [
                {
                    "prompt": decode(call.prompt_ids, skip_special_tokens=False),
                    "response": call.response_text,
                    "prompt_tokens": len(call.prompt_ids),
                    "response_tokens": len(call.response_ids),
                    "finish_reason": call.finish_reason,
                    "flags": call.flags,
                    "tool_calls": [c["function"] for c in (call.reply or {}).get("tool_calls") or []],
                    "extends_previous": call.extends_previous,
                }
                for call in episode.calls
            ],
        }


def _drop_later_trajectories(folder: Path, last_step: int) -> None:
    """A resumed run writes the steps after its checkpoint anew; the killed run's files of those steps go, so
    trajectories/ holds each trained step once (the ones this run reaches are written again)."""
    for path in folder.glob("*_step_*.jsonl"):
        step = path.stem.rsplit("_step_", 1)[-1]
        if step.isdigit() and int(step) > last_step:
            path.unlink()


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the lines of steps <= last_step (the checkpoint's); a torn last line from a kill is dropped too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
