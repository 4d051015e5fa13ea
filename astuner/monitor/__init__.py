"""What a run reports: its outputs (tensorboard, metrics.jsonl, trajectories, progress bars; the log file is
astuner/logs.py) and the metrics of each step and validation, assembled from episodes, samples and the stages'
own figures."""

from astuner.logs import announce, run_log_path, setup_logging
from astuner.monitor.metrics import (
    StepMetrics,
    episode_metrics,
    parse_failure_rate,
    pipeline_metrics,
    staleness_metrics,
    tool_calls_received,
    validation_metrics,
    void_note,
    warn_pipeline,
    zero_adv_group_fraction,
)
from astuner.monitor.outputs import Monitor

__all__ = [
    "Monitor", "StepMetrics", "announce", "episode_metrics", "parse_failure_rate", "pipeline_metrics",
    "run_log_path", "setup_logging", "staleness_metrics", "tool_calls_received", "validation_metrics",
    "void_note",
    "warn_pipeline", "zero_adv_group_fraction",
]
