"""The OpenAI front ends, the merge sample mode and the token-pipeline preflight, measured.

    python bench/bench_openai_frontends.py [--conversations 16] [--max-tokens 64] [--react-tasks 8]

Front ends: the same 16 concurrent conversations (fixed seeds, no stop token, so every path samples the same
tokens and does the same model work) through `model_tuner.chat`, the in-process `openai.AsyncOpenAI`, and the
loopback HTTP endpoint (httpx, with and without streaming). Reported as generated tokens/s and the ratio to
`chat`, best of --repeats after a warm-up.

Merge: the ReAct math tutorial (AgentScope ReActAgent, Python tool) rolled out on --react-tasks GSM8K sample
tasks x 2 with the demo model, and a three-turn self-check agent (answer, check, answer again) on the same
tasks; each batch of episodes becomes samples per_call and merged, and one forward+backward over each sample set
is timed once (the trainer work merge saves; a whole batch takes minutes on CPU). Also the merge ratio and
prefix reuse.

Preflight: seconds of the token-pipeline check (template, parser, extension, engine vs trainer logprobs), at
start and warm, and without the logprob check.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from timing import best_of

REPO = Path(__file__).resolve().parents[1]


def make_tuner(engine, tokenizer, gateway, seed, max_tokens):
    from astuner.model_tuner import ChatRenderer, ModelTuner, TunerLimits, get_tool_parser

    return ModelTuner(engine, tokenizer, ChatRenderer(tokenizer), get_tool_parser("hermes"),
                      TunerLimits(4096, max_tokens, 100000, 4096), 1.0, stop_token_ids=(),
                      madness_checks=(), seed=seed, gateway=gateway)


def bench_frontends(model_path, tokenizer, args):
    import httpx

    from astuner.engine.hf_engine import HFEngine
    from astuner.model_tuner.frontends.gateway import Gateway

    engine = HFEngine(model_path, max_batch_size=args.conversations, pad_token_id=tokenizer.pad_token_id or 0)
    gateway = Gateway()
    questions = [f"Write a short story about the number {i}." for i in range(args.conversations)]
    n_tokens = args.conversations * args.max_tokens

    async def one(path: str, i: int):
        tuner = make_tuner(engine, tokenizer, gateway, seed=1000 + i, max_tokens=args.max_tokens)
        messages = [{"role": "user", "content": questions[i]}]
        if path == "chat":
            await tuner.chat(messages)
        elif path == "client":
            await tuner.get_openai_client().chat.completions.create(model="p", messages=messages)
        else:
            body = {"model": "p", "messages": messages, "stream": path == "http-stream"}
            async with httpx.AsyncClient(timeout=600) as http:
                resp = await http.post(f"{tuner.base_url}/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {tuner.api_key}"})
                resp.raise_for_status()
        tuner.close()
        assert len(tuner.calls[0].response_ids) == args.max_tokens
        return tuner.calls[0].response_ids

    def run(path):
        loop = asyncio.new_event_loop()
        try:
            async def everything():
                return await asyncio.gather(*(one(path, i) for i in range(args.conversations)))

            return loop.run_until_complete(everything())
        finally:
            loop.close()

    reference = run("chat")
    results = {}
    for path in ("chat", "client", "http", "http-stream"):
        assert run(path) == reference, f"{path} sampled different tokens"  # same seeds, same work
        results[path] = n_tokens / best_of(lambda: run(path), args.repeats)
    gateway.close()
    engine.shutdown()
    base = results["chat"]
    print(f"front end  model_tuner.chat           {base:7.1f} tok/s   ({n_tokens} tokens, "
          f"{args.conversations} conversations)")
    for path, label in (("client", "in-process AsyncOpenAI"), ("http", "HTTP endpoint"),
                        ("http-stream", "HTTP endpoint, stream")):
        print(f"front end  {label:<26} {results[path]:7.1f} tok/s   x{results[path] / base:.3f} of chat")


def bench_merge_and_preflight(model_path, tokenizer, args):
    from astuner.algorithm.samples import episodes_to_samples, merge_ratio
    from astuner.config import load_config
    from astuner.run_models import build_runtime

    overrides = [
        "astuner.model.path=demo:smollm2-135m-instruct",
        f"astuner.task_reader.huggingface_dat_repo.dataset_path={REPO / 'tutorial/example_math_agent/gsm8k_sample'}",
        "astuner.rollout.num_repeat=2", "astuner.rollout.max_response_length_in_one_turn=256",
        "astuner.rollout.max_model_len=4096", "astuner.rollout.max_env_worker=16", "astuner.rollout.preflight=off",
        "trinity.trainer.max_token_len_per_gpu=4096", "astuner.experiment_dir=/tmp/astuner_bench_merge",
    ]
    loaded = load_config(REPO / "tutorial/example_math_agent/math_agent.yaml", overrides)
    rt = build_runtime(loaded, "debug")

    from astuner.model_tuner.pipeline_check import engine_trainer_logprob_check, run_preflight

    runner = rt.runner
    check = engine_trainer_logprob_check(rt.engine, rt.trainer, rt.tokenizer, runner.renderer,
                                         runner.stop_token_ids)
    preflight = lambda logprobs: run_preflight(  # noqa: E731
        "warn", runner.renderer, runner.chat_format, runner.parser, runner.reasoning_parser, runner.stop_texts(),
        check if logprobs else None)
    start = time.perf_counter()
    rows = preflight(True)
    first_s = time.perf_counter() - start
    again_s = best_of(lambda: preflight(True), args.repeats)
    template_s = best_of(lambda: preflight(False), args.repeats)
    checks = ", ".join(f"{r.name} {'ok' if r.ok else 'FAIL'}" for r in rows)
    print(f"preflight  {first_s:.2f} s at start (first engine call included), {again_s:.2f} s warm, "
          f"{template_s * 1000:.0f} ms without the logprob check ({checks})")

    from astuner.workflow import Workflow, WorkflowOutput

    class SelfCheckWorkflow(Workflow):
        """Three turns per episode whatever the model does: answer, check, answer again."""

        async def execute(self, workflow_task, model_tuner):
            messages = [{"role": "user", "content": workflow_task.task.main_query}]
            for follow_up in ("Check your work step by step.", "Give the final answer within \\boxed{}."):
                messages.append(await model_tuner.chat(messages))
                messages.append({"role": "user", "content": follow_up})
            reply = await model_tuner.chat(messages)
            return WorkflowOutput(reward=0.0, metadata={"final_answer": reply["content"]})

    tasks = rt.train_tasks[: args.react_tasks]
    workloads = [("react", runner.run(tasks, step=1))]
    runner.workflow_cls = SelfCheckWorkflow
    workloads.append(("self-check", runner.run(tasks, step=1)))
    for name, episodes in workloads:
        for i, e in enumerate(episodes):  # distinct rewards so every sample carries a gradient
            e.reward = float(i % 2)
        timings = {}
        for mode in ("per_call", "merge"):
            samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                          max_sample_per_task=8, sample_mode=mode)
            rt.trainer.optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()  # once: a step over a whole batch takes minutes on CPU
            rt.trainer.forward_backward(samples)
            timings[mode] = (len(samples), sum(s.num_tokens for s in samples), time.perf_counter() - start)
        calls = sum(len(e.calls) for e in episodes)
        reuse = sum(c.extends_previous for e in episodes for c in e.calls) / max(calls, 1)
        (n1, t1, s1), (n2, t2, s2) = timings["per_call"], timings["merge"]
        print(f"{name:<10} {len(episodes)} episodes, {calls} calls, prefix reuse {reuse:.2f}, "
              f"merge ratio {merge_ratio(episodes):.2f}")
        print(f"{name:<10} per_call: {n1} samples, {t1} tokens forwarded, {s1:.1f} s forward+backward")
        print(f"{name:<10} merge:    {n2} samples, {t2} tokens forwarded, {s2:.1f} s ({1 - s2 / s1:.1%} less time, "
              f"{1 - t2 / t1:.1%} fewer tokens)")
    rt.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--react-tasks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["frontends", "merge"], help="run one part")
    args = parser.parse_args()

    from astuner.model_cache import resolve_model_path
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, best of {args.repeats}")
    if args.only != "merge":
        bench_frontends(model_path, tokenizer, args)
    if args.only != "frontends":
        bench_merge_and_preflight(model_path, tokenizer, args)


if __name__ == "__main__":
    main()
