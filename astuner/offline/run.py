"""A run of `algorithm.type: sft | dpo | orpo`: batches of `offline_data.train_file` through the Trainer, on the
same loop as a GRPO run (astuner/loop.py with the stages of offline/stages.py), set up by the same
`runtime.prepare` with the offline data source (task_reader/sources.py).

Same run folder, metrics, progress, checkpoints (global_step_N, resumable at the exact batch), summary line and
schedule keys (`data.train_batch_size` examples or pairs per step, `total_epochs`, `total_training_steps`,
`save_freq`, `test_freq`) as a GRPO run. Validation logs `val/loss` on `offline_data.val_file`; evaluate task
accuracy with `astuner eval --model <checkpoint>`.
"""

from __future__ import annotations

from pathlib import Path

from astuner.loop import LoopSettings, RunSummary, count_steps, drive


def run(loaded, checkpoint: Path | None = None) -> RunSummary:
    from astuner.logs import setup_logging
    from astuner.offline.stages import OfflineStages
    from astuner.runtime import prepare
    from astuner.trainer.build import build_trainer

    typed = loaded.typed
    setup_logging(loaded.experiment_dir)
    settings = LoopSettings.from_config(typed)
    prep = prepare(loaded, "debug", total_steps_of=lambda n: count_steps(n, settings))
    trainer = build_trainer(typed, prep.facts.algorithm, prep.model_path, prep.total_steps,
                            micro_batch_tokens=prep.plan.micro_batch_token_budget)
    stages = OfflineStages(trainer, prep.tokenizer, prep.facts.algorithm, loaded.experiment_dir)
    return drive(loaded, settings, stages, prep.train_tasks, prep.val_tasks, prep.total_steps, prep.tokenizer,
                 checkpoint)
