"""A run of `algorithm.type: sft | dpo | orpo`: batches of `offline_data.train_file` through the Trainer.

Same run folder, metrics, progress, checkpoints (global_step_N, resumable at the exact batch) and schedule keys
(`data.train_batch_size` examples or pairs per step, `total_epochs`, `total_training_steps`, `save_freq`,
`test_freq`) as a GRPO run. Validation logs `val/loss` on `offline_data.val_file`; evaluate task accuracy with
`astuner eval --model <checkpoint>`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

from astuner.errors import UserError
from astuner.loop import LoopSettings, ResumeState, RunSummary, count_steps, task_batches

log = logging.getLogger(__name__)


def run_offline(loaded, checkpoint: Path | None = None) -> RunSummary:
    from astuner import preflight
    from astuner.model_tuner import ChatRenderer
    from astuner.monitor import Monitor, announce, setup_logging
    from astuner.offline.data import load_examples
    from astuner.offline.steps import preference_step, sft_validation_loss
    from astuner.runtime import build_policy_model_path, build_trainer, load_tokenizer, stop_token_ids

    typed = loaded.typed
    a, tc = typed.astuner, typed.astuner.trainer_common
    kind = tc.algorithm.type
    setup_logging(loaded.experiment_dir)
    settings = LoopSettings.from_config(typed)
    if a.offline_data.train_file is None:
        raise UserError(f"astuner.offline_data.train_file is not set: algorithm.type {kind} trains on a jsonl of "
                        "conversations (format in the default config's doc of offline_data.train_file)")
    model_path = build_policy_model_path(typed)
    facts = preflight.read_model_facts(model_path)
    max_len = preflight.resolve_max_model_len(a.rollout.max_model_len, facts, 1)  # whole conversations, no turn cap
    tokenizer = load_tokenizer(model_path)
    renderer = ChatRenderer(tokenizer, a.rollout.tool_prompt)
    ends = tuple(dict.fromkeys(tokenizer.decode([i], skip_special_tokens=False)
                               for i in stop_token_ids(model_path, tokenizer)))

    def read(key: str, value: str):
        path = Path(value) if Path(value).is_absolute() else loaded.config_dir / value
        items, dropped = load_examples(path, kind, renderer, ends, max_len, key)
        if dropped["too_long"]:
            log.warning("%s: %d of %d rows are longer than max_model_len=%d tokens and are left out", key,
                        dropped["too_long"], dropped["too_long"] + len(items), max_len)
        return items

    train = read("astuner.offline_data.train_file", a.offline_data.train_file)
    val = read("astuner.offline_data.val_file", a.offline_data.val_file) if a.offline_data.val_file else []
    total = count_steps(len(train), settings)
    plan = preflight.make_plan(typed, "debug", facts, max_len, total)
    announce(f"{kind}: {len(train)} training and {len(val)} validation "
             f"{'conversations' if kind == 'sft' else 'pairs'}, {settings.train_batch_size} per step\n"
             + plan.block(facts))
    preflight.check_fits(plan, facts)
    trainer = build_trainer(typed, model_path, total, micro_batch_tokens=plan.micro_batch_token_budget)
    resume = ResumeState()
    if checkpoint is not None:
        resume = ResumeState(**trainer.load_checkpoint(checkpoint))
        announce(f"resumed at step {resume.step} of {total} from {checkpoint}")
    monitor = Monitor(loaded.experiment_dir, total, tokenizer=tokenizer,
                      resume_step=None if checkpoint is None else resume.step)

    def train_on(batch: list, first: int) -> dict[str, float]:
        if kind == "sft":
            return trainer.train_step([x.as_sample(f"sft{first + i}") for i, x in enumerate(batch)], objective="sft")
        return preference_step(trainer, batch, kind, tc.algorithm.beta)

    def validate(step: int) -> None:
        if not val:
            return
        if kind == "sft":
            metrics = {"val/loss": sft_validation_loss(trainer, [x.as_sample(f"val{i}") for i, x in enumerate(val)])}
        else:
            metrics = {f"val/{k}": v for k, v in preference_step(trainer, val, kind, tc.algorithm.beta,
                                                                 train=False).items()
                       if k not in ("train_tokens", "train_tokens_per_s", "num_pairs")}
        monitor.log_metrics(step, metrics)
        resume.val_scores[str(step)] = metrics["val/loss"]
        log.info("step %d validation loss %.4f", step, metrics["val/loss"])

    summary = RunSummary(steps=resume.step)
    started = time.perf_counter()
    try:
        if settings.val_before_train and resume.step == 0:
            validate(0)
        batches = task_batches(train, settings, resume.epoch, resume.position)
        for step, (batch, epoch, position) in enumerate(batches, start=resume.step + 1):
            if step > total:
                break
            t0 = time.perf_counter()
            metrics = {f"actor/{k}": v for k, v in train_on(batch, position - len(batch)).items()}
            metrics["time/train_s"] = time.perf_counter() - t0
            monitor.log_metrics(step, metrics)
            summary.steps = resume.step = step
            resume.epoch, resume.position = epoch, position
            if step % settings.test_freq == 0 or step == total:
                validate(step)
            if step % settings.save_freq == 0 or step == total:
                path = loaded.experiment_dir / f"global_step_{step}"
                trainer.save_checkpoint(path, tokenizer=tokenizer, run_state=asdict(resume))
                summary.last_checkpoint = path
                log.info("saved checkpoint %s", path)
            monitor.step_done(step, metrics)
    finally:
        monitor.close()
    summary.seconds = time.perf_counter() - started
    line = f"{a.project_name}: {kind} {summary.steps} steps in {summary.seconds:.0f}s"
    if resume.val_scores:
        first, last = min(resume.val_scores, key=int), max(resume.val_scores, key=int)
        line += (f"; validation loss {resume.val_scores[first]:.4f} (step {first}) -> "
                 f"{resume.val_scores[last]:.4f} (step {last})")
    if summary.last_checkpoint is not None:
        line += f"; checkpoint {summary.last_checkpoint}"
    log.info(line)
    print(line, flush=True)
    return summary
