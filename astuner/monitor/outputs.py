"""Run outputs: tensorboard scalars, metrics.jsonl, saved trajectories, the log viewer's store, console progress
(the log file itself: astuner/logs.py)."""

from __future__ import annotations

import json
import logging
import math
import threading
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
        self._postfix_lock = threading.Lock()  # the watchdog's thread writes the "slow" entry

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        log.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        with self._postfix_lock:
            for key, short in _POSTFIX.items():
                if key in metrics:
                    self._postfix[short] = f"{metrics[key]:.3g}"
            if metrics.get("val/void"):
                self._postfix["val_acc"] = "n/a"
            self.bar.set_postfix(dict(self._postfix), refresh=True)

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
        with self._postfix_lock:
            if self._postfix.pop("slow", None) is not None:
                self.bar.set_postfix(dict(self._postfix), refresh=False)
        self.bar.update(1)

    def show_stall(self, line: str) -> None:
        """The watchdog's line (astuner/watchdog.py) on the step bar until the step ends."""
        with self._postfix_lock:
            self._postfix["slow"] = line
            self.bar.set_postfix(dict(self._postfix), refresh=True)

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
            "cut": episode.cut,
            "error": episode.error,
            "error_summary": episode.error_summary,
            "seconds": round(episode.seconds, 3),
            "policy_version": episode.policy_version,
            "output_metadata": episode.output_metadata,
            "agent_rewards": episode.agent_rewards,
            "calls": [
                {
                    "agent": call.agent,
                    "model": call.model,
                    "prompt": decode(call.prompt_ids, skip_special_tokens=False),
                    "response": call.response_text,
                    "prompt_tokens": len(call.prompt_ids),
                    "response_tokens": len(call.response_ids),
                    "finish_reason": call.finish_reason,
                    "cut": call.cut,
                    "segment": call.segment,
                    "context": call.context,
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
