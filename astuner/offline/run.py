"""A run of `algorithm.type: sft | dpo | orpo`: batches of `offline_data.train_file` through the Trainer, on the
same loop as a GRPO run (astuner/loop.py with the stages of offline/stages.py).

Same run folder, metrics, progress, checkpoints (global_step_N, resumable at the exact batch), summary line and
schedule keys (`data.train_batch_size` examples or pairs per step, `total_epochs`, `total_training_steps`,
`save_freq`, `test_freq`) as a GRPO run. Validation logs `val/loss` on `offline_data.val_file`; evaluate task
accuracy with `astuner eval --model <checkpoint>`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from astuner.algorithm.catalog import algorithm
from astuner.errors import UserError
from astuner.loop import LoopSettings, RunSummary, count_steps, drive

log = logging.getLogger(__name__)


def run(loaded, checkpoint: Path | None = None) -> RunSummary:
    from astuner import preflight
    from astuner.logs import announce, setup_logging
    from astuner.model_tuner import ChatRenderer
    from astuner.offline.data import load_examples
    from astuner.offline.stages import OfflineStages
    from astuner.runtime import (
        build_policy_model_path,
        build_trainer,
        load_tokenizer,
        stop_token_ids,
    )

    typed = loaded.typed
    a, tc = typed.astuner, typed.astuner.trainer_common
    kind = tc.algorithm.type
    spec = algorithm(kind)
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
        items, dropped = load_examples(path, spec.data, renderer, ends, max_len, key)
        if dropped["too_long"]:
            log.warning("%s: %d of %d rows are longer than max_model_len=%d tokens and are left out", key,
                        dropped["too_long"], dropped["too_long"] + len(items), max_len)
        return items

    train = read("astuner.offline_data.train_file", a.offline_data.train_file)
    val = read("astuner.offline_data.val_file", a.offline_data.val_file) if a.offline_data.val_file else []
    total = count_steps(len(train), settings)
    plan = preflight.make_plan(typed, "debug", facts, max_len, total)
    announce(f"{kind}: {len(train)} training and {len(val)} validation "
             f"{spec.data}, {settings.train_batch_size} per step\n"
             + plan.block(facts))
    preflight.check_fits(plan, facts)
    trainer = build_trainer(typed, model_path, total, micro_batch_tokens=plan.micro_batch_token_budget)
    stages = OfflineStages(trainer, tokenizer, spec, tc.algorithm.beta, loaded.experiment_dir)
    return drive(loaded, settings, stages, train, val, total, tokenizer, checkpoint)
