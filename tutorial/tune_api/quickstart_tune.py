"""The quick-start (additions in \\boxed{}, demo model, CPU) written with tune(): a function workflow, a function
judge and config objects. The same run as a YAML: quickstart_tune.yaml (astuner --conf ...).

    python tutorial/tune_api/quickstart_tune.py

Outputs: launcher_record/quickstart_tune/ under the working directory (config.yaml, astuner.log, metrics.jsonl,
tensorboard/, trajectories/, global_step_N/), as for `astuner --conf`.
"""

import re
from pathlib import Path

from astuner import AlgorithmConfig, DatasetConfig, JudgeOutput, TunerModelConfig, WorkflowOutput, tune

DATA = Path(__file__).resolve().parents[1] / "quickstart" / "data"


async def add_numbers(task, model, auxiliary_models):
    reply = await model.chat([{"role": "user", "content": task["question"]}])
    return WorkflowOutput(response=reply["content"])


async def boxed_sum(task, response, auxiliary_models):
    boxed = re.findall(r"\\boxed\{\s*(-?\d+)\s*\}", response or "")
    correct = bool(boxed) and boxed[-1] == str(task["answer"])
    # Format credit keeps a signal while the model learns the \boxed{} form; one box only, so scattering boxed
    # numbers earns nothing (tutorial/quickstart/boxed_judge.py).
    partial = 0.3 if len(re.findall(r"\\boxed\{", response or "")) == 1 and boxed else 0.0
    return JudgeOutput(reward=1.0 if correct else partial, metrics={"boxed": float(bool(boxed))},
                       is_success=correct)


if __name__ == "__main__":
    tune(
        workflow_func=add_numbers,
        judge_func=boxed_sum,
        model=TunerModelConfig(model_path="demo:smollm2-135m-instruct", max_tokens=40, max_model_len=512),
        train_dataset=DatasetConfig(path=str(DATA / "train.jsonl"), task_id_field="id"),
        eval_dataset=DatasetConfig(path=str(DATA / "val.jsonl"), task_id_field="id"),
        algorithm=AlgorithmConfig(group_size=8, batch_size=8, learning_rate=3e-5, total_steps=20, extra={
            "trainer_common.test_freq": 5, "trainer_common.optim.lr_scheduler_type": "cosine",
            "trainer_common.optim.min_lr_ratio": 0.1, "data.max_response_length": 40,
            "rollout.compute_madness_checklist": ["nonsense"], "trainer_common.micro_batch_token_budget": 2048}),
        project_name="quickstart_tune",
    )
