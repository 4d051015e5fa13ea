"""Training on data instead of rollouts (`algorithm.type: sft | dpo | orpo`): the same Trainer, other losses.

`data` turns chat jsonl into token ids with an assistant-token mask, `steps` holds the preference step, `run`
the run itself (batches, validation loss, checkpoints and resume as for GRPO), `warmstart` the command that
writes demonstrations for an agent's tools (astuner/offline/tool_demos.py) and runs the SFT on them.
"""
