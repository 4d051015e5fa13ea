"""Throughput of astuner's rollout and GRPO step next to their floors, on the same inputs.

    python bench/bench_rollout_train.py [--model demo:smollm2-135m-instruct] [--prompts 32] [--max-tokens 64]

Rollout: tokens/s generated through Workflow + ModelTuner + RolloutRunner (asyncio episodes, chat rendering,
tool parsing, madness checks, recording) next to the raw engine's batched generate on the same prompt ids.
Greedy decoding, so both produce the same tokens and do the same model work.

Train: tokens/s (prompt + response) of Trainer.train_step on a batch of samples next to a minimal hand-written
step on the same batch: one padded forward with full logits, log_softmax, advantage-weighted sum, backward,
AdamW. Every sample has a non-zero advantage, so the trainer cannot skip any.

Each measurement is the best of --repeats runs after one warm-up (the machine is shared; the best run is the
least disturbed). Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_rollout(model_path, tokenizer, prompts_text, max_tokens, repeats):
    from astuner.engine.hf_engine import HFEngine
    from astuner.model_tuner import TunerLimits
    from astuner.rollout import RolloutRunner, RolloutSettings
    from astuner.runtime import stop_token_ids
    from astuner.types import SamplingParams, Task
    from astuner.workflow import Workflow, WorkflowOutput

    class ChatWorkflow(Workflow):
        async def execute(self, workflow_task, model_tuner):
            reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
            return WorkflowOutput(reward=0.0, metadata={"final_answer": reply["content"]})

    stops = stop_token_ids(model_path, tokenizer)
    engine = HFEngine(model_path, max_batch_size=len(prompts_text), pad_token_id=tokenizer.pad_token_id or 0)
    settings = RolloutSettings(
        num_repeat=1, max_env_worker=len(prompts_text), temperature=0.0, episode_timeout=600,
        agent_madness_reward=0.0, madness_checks=("nonsense", "wrong_toolcall"), tool_prompt="auto",
        tool_parser="hermes",
        limits=TunerLimits(max_model_len=4096, max_tokens_per_turn=max_tokens, max_response_tokens=max_tokens,
                           max_prompt_length=4096),
    )
    runner = RolloutRunner(settings, engine, tokenizer, ChatWorkflow, None, stops)  # the workflow scores itself
    tasks = [Task(f"t{i}", q) for i, q in enumerate(prompts_text)]
    prompt_ids = [runner.renderer.render([{"role": "user", "content": q}], None) for q in prompts_text]

    raw_tokens, flow_tokens = [0], [0]

    def raw():
        res = engine.generate_batch(prompt_ids, SamplingParams(0.0, max_tokens, stops))
        raw_tokens[0] = sum(len(r.token_ids) for r in res)

    def flow():
        episodes = runner.run(tasks, validation=True)  # validation = one greedy episode per task
        flow_tokens[0] = sum(len(c.response_ids) for e in episodes for c in e.calls)

    t_raw = best_of(raw, repeats)
    t_flow = best_of(flow, repeats)
    engine.shutdown()
    assert raw_tokens[0] == flow_tokens[0], "greedy outputs differ: the comparison would not be like for like"
    return raw_tokens[0] / t_raw, flow_tokens[0] / t_flow, raw_tokens[0]


def make_samples(tokenizer, prompts_text, response_len, seed=0):
    from astuner.types import Sample

    rng = random.Random(seed)
    samples = []
    for i, q in enumerate(prompts_text):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        n = rng.randint(response_len // 2, response_len)
        response = [rng.randrange(100, 10000) for _ in range(n)]
        samples.append(Sample(prompt, response, [-2.0] * n, rng.choice([-1.0, 1.0]), 1.0, f"e{i // 4}"))
    return samples


def bench_train(model_path, samples, repeats, budget):
    from transformers import AutoModelForCausalLM

    from astuner.trainer import Trainer

    tokens = sum(s.num_tokens for s in samples)
    trainer = Trainer(
        model_path, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
        clip_ratio_high=0.28, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3", loss_agg_mode="token-mean",
        norm_length=128, max_token_len_per_micro_batch=budget,
    )
    t_grpo = best_of(lambda: trainer.train_step(samples), repeats)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    width = max(s.num_tokens for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    target_mask = torch.zeros(len(samples), width - 1)
    weight = torch.zeros(len(samples), 1)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        target_mask[i, len(s.prompt_ids) - 1 : len(seq) - 1] = 1
        weight[i] = s.advantage

    def floor():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(weight * logp * target_mask).sum() / target_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    t_floor = best_of(floor, repeats)
    return tokens / t_grpo, tokens / t_floor, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--train-samples", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--budget", type=int, default=8192, help="micro-batch token budget of the trainer")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from astuner.model_cache import resolve_model_path

    hf_logging.disable_progress_bar()
    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(0)
    prompts = [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Explain briefly." for _ in range(args.prompts)]
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, best of {args.repeats}")

    raw, flow, n = bench_rollout(model_path, tokenizer, prompts, args.max_tokens, args.repeats)
    print(f"rollout  raw engine generate   {raw:8.1f} tok/s   ({n} tokens, {args.prompts} prompts, greedy)")
    print(f"rollout  workflow + ModelTuner {flow:8.1f} tok/s   {100 * (flow / raw - 1):+.1f}% vs raw")

    samples = make_samples(tokenizer, prompts[: args.train_samples], args.response_len)
    grpo, floor, n = bench_train(model_path, samples, args.repeats, args.budget)
    print(f"train    minimal fwd/bwd/AdamW {floor:8.1f} tok/s   ({n} tokens, {len(samples)} samples)")
    print(f"train    astuner GRPO step     {grpo:8.1f} tok/s   {100 * (grpo / floor - 1):+.1f}% vs floor")


if __name__ == "__main__":
    main()
