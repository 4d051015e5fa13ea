"""What a run reports: its outputs (log file, tensorboard, metrics.jsonl, trajectories, progress bars) and the
metrics of each step and validation, assembled from episodes, samples and the stages' own figures."""

from astuner.monitor.metrics import (
    StepMetrics,
    episode_metrics,
    parse_failure_rate,
    pipeline_metrics,
    staleness_metrics,
    tool_calls_received,
    validation_metrics,
    warn_pipeline,
    zero_adv_group_fraction,
)
from astuner.monitor.outputs import Monitor, announce, run_log_path, setup_logging

__all__ = [
    "Monitor", "StepMetrics", "announce", "episode_metrics", "parse_failure_rate", "pipeline_metrics",
    "run_log_path", "setup_logging", "staleness_metrics", "tool_calls_received", "validation_metrics",
    "warn_pipeline", "zero_adv_group_fraction",
]
