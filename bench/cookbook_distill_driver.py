"""The tinker-cookbook's on-policy distillation trainer (`tinker_cookbook.distillation.train_on_policy`), run as its
recipe (`recipes/distillation/on_policy_distillation.py`) configures it, on local prompts: the recipe's own datasets
(DeepMath, Tulu 3) come from the Hugging Face hub, which this machine cannot reach. Run with the cookbook's python
by bench/tinker_cookbook.py --recipe distill; its arguments are the recipe's (key=value), plus prompts_file."""

from __future__ import annotations

import asyncio
import json
import sys


def local_prompts_builder():
    """The builder class (the cookbook's imports here: this file is imported by tests/test_bench_imports.py in
    astuner's environment, which has no cookbook)."""
    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.distillation.datasets import PromptOnlyDataset
    from tinker_cookbook.rl.types import RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    @chz.chz
    class LocalPrompts(RLDatasetBuilder):
        """The recipe's PromptOnlyDataset over the `question` of each line of a JSONL file."""

        prompts_file: str
        groups_per_batch: int
        group_size: int
        model_name_for_tokenizer: str
        renderer_name: str

        async def __call__(self):
            tokenizer = get_tokenizer(self.model_name_for_tokenizer)
            renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
            with open(self.prompts_file) as f:
                prompts = [json.loads(line)["question"] for line in f if line.strip()]
            return PromptOnlyDataset(prompts, self.groups_per_batch, self.group_size, renderer, tokenizer,
                                     max_prompt_tokens=1024, dataset_name="local"), None

    return LocalPrompts


def main(argv: list[str]) -> None:
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    args = dict(a.split("=", 1) for a in argv)
    groups, group_size = int(args["groups_per_batch"]), int(args.get("group_size", 4))
    dataset = DistillationDatasetConfig(
        dataset_builder=local_prompts_builder()(
            prompts_file=args["prompts_file"], groups_per_batch=groups, group_size=group_size,
            model_name_for_tokenizer=args["model_name"], renderer_name=args["renderer_name"]),
        teacher_config=TeacherConfig(base_model=args["teacher_model"]),
        groups_per_batch=groups)
    config = train_on_policy.Config(
        recipe_name="recipe_distillation_on_policy", learning_rate=float(args["learning_rate"]),
        dataset_configs=[dataset], model_name=args["model_name"], renderer_name=args["renderer_name"],
        lora_rank=int(args["lora_rank"]), max_tokens=int(args["max_tokens"]),
        kl_penalty_coef=float(args.get("kl_penalty_coef", 1.0)), kl_discount_factor=0.0, num_substeps=1,
        loss_fn=args.get("loss_fn", "importance_sampling"), log_path=args["log_path"], base_url=args["base_url"],
        eval_every=0, save_every=0, max_steps=int(args["max_steps"]))
    asyncio.run(train_on_policy.main(config))


if __name__ == "__main__":
    main(sys.argv[1:])
