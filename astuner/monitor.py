"""Run outputs: log file, tensorboard scalars, metrics.jsonl, saved trajectories, console progress."""

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


def setup_logging(experiment_dir: Path) -> Path:
    """Log INFO and above to <experiment_dir>/astuner.log; the console shows warnings and the progress bar."""
    experiment_dir.mkdir(parents=True, exist_ok=True)
    path = experiment_dir / "astuner.log"
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        if getattr(handler, "_astuner", False):
            root.removeHandler(handler)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = _TqdmHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("astuner: %(levelname)s: %(message)s"))
    for handler in (file_handler, console):
        handler._astuner = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    return path


class _TqdmHandler(logging.Handler):
    """Console output that does not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


class Monitor:
    def __init__(self, experiment_dir: Path, total_steps: int, tokenizer=None, show_progress: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.dir = experiment_dir
        self.tokenizer = tokenizer
        self.writer = SummaryWriter(log_dir=str(experiment_dir / "tensorboard"))
        self.metrics_file = open(experiment_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.trajectory_dir = experiment_dir / "trajectories"
        self.trajectory_dir.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=total_steps, desc="astuner", unit="step", disable=not show_progress, dynamic_ncols=True)
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

    def save_episodes(self, step: int, episodes: list[Episode], tag: str) -> None:
        path = self.trajectory_dir / f"{tag}_step_{step:06d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for episode in episodes:
                f.write(json.dumps(self._episode_record(episode), ensure_ascii=False, default=str) + "\n")

    def episode_bar(self, description: str, total: int):
        """A second, transient bar under the step bar: episodes finished in the current rollout."""
        from tqdm import tqdm

        return tqdm(total=total, desc=f"  {description}", unit="episode", leave=False, position=1,
                    disable=self.bar.disable, dynamic_ncols=True)

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.metrics_file.close()

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
            "seconds": round(episode.seconds, 3),
            "output_metadata": episode.output_metadata,
            "calls": [
                {
                    "prompt": decode(call.prompt_ids, skip_special_tokens=False),
                    "response": call.response_text,
                    "prompt_tokens": len(call.prompt_ids),
                    "response_tokens": len(call.response_ids),
                    "finish_reason": call.finish_reason,
                    "flags": call.flags,
                }
                for call in episode.calls
            ],
        }
