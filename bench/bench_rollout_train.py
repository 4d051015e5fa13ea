"""Throughput of astuner's rollout and GRPO step next to their floors, on the same inputs.

    python bench/bench_rollout_train.py [--model demo:smollm2-135m-instruct] [--prompts 32] [--max-tokens 64]

Rollout: tokens/s generated through Workflow + ModelTuner + RolloutRunner (asyncio episodes, chat rendering,
tool parsing, madness checks, recording) next to the raw engine's batched generate on the same prompt ids.
Greedy decoding, so both produce the same tokens and do the same model work.

Engine: the HF engine's batched sampling (temperature 1, logprobs recorded) next to plain `transformers`
`model.generate(do_sample=True)` on the same left-padded batch (default 16 prompts x 64 new tokens, no early
stop), and the engine again with a seed per request (what rollouts use, for reproducible runs).

Train: tokens/s (prompt + response) of Trainer.train_step on a batch of samples next to the step a careful
engineer writes by hand for the same loss: one padded forward of the decoder, the LM head applied only at the
positions that predict response tokens, logprob = logit[token] - logsumexp (no full log_softmax), advantage-
weighted token mean, backward, grad clip, AdamW. Every sample has a non-zero advantage, so the trainer cannot
skip any. The trainer also computes the entropy metric; its cost is reported on its own (trainer with it off).

Each measurement is the best of --repeats runs after one warm-up (the machine is shared; the best run is the
least disturbed). Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import random

import torch

from timing import best_of


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
        tool_call_parser="hermes",
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


def bench_engine(model_path, tokenizer, prompts_text, max_tokens, repeats):
    from transformers import AutoModelForCausalLM

    from astuner.engine.hf_engine import HFEngine, _Request
    from astuner.types import SamplingParams

    pad = tokenizer.pad_token_id or 0
    prompt_ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        for q in prompts_text
    ]
    n_tokens = len(prompt_ids) * max_tokens  # no stop token: every row makes max_tokens tokens
    engine = HFEngine(model_path, max_batch_size=len(prompt_ids), pad_token_id=pad, seed=0)

    def run_engine(seeded: bool):
        requests = [_Request(p, SamplingParams(1.0, max_tokens, (), seed=i if seeded else None))
                    for i, p in enumerate(prompt_ids)]
        with torch.no_grad():
            out = engine._decode(requests)
        assert sum(len(r.token_ids) for r in out) == n_tokens

    t_engine = best_of(lambda: run_engine(False), repeats)
    t_seeded = best_of(lambda: run_engine(True), repeats)
    engine.shutdown()
    del engine

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run_generate():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad)
        assert out.shape[1] - width == max_tokens

    t_generate = best_of(run_generate, repeats)
    return n_tokens / t_engine, n_tokens / t_seeded, n_tokens / t_generate, n_tokens


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
    forward = trainer.forward_logprobs
    trainer.forward_logprobs = lambda batch, **kw: forward(batch, **{**kw, "with_entropy": False})
    t_no_entropy = best_of(lambda: trainer.train_step(samples), repeats)
    del trainer.forward_logprobs  # back to the method

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    # Right padding, no mask (causal attention hides the pads from real tokens), last token not fed.
    inputs = [s.prompt_ids + s.response_ids[:-1] for s in samples]
    width = max(len(x) for x in inputs)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    rows, cols, targets, weights = [], [], [], []
    n_response = sum(len(s.response_ids) for s in samples)
    for i, (s, x) in enumerate(zip(samples, inputs)):
        ids[i, : len(x)] = torch.tensor(x)
        P, L = len(s.prompt_ids), len(s.response_ids)
        rows += [i] * L
        cols += range(P - 1, P + L - 1)
        targets += s.response_ids
        weights += [s.advantage / n_response] * L
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    targets_t, weights_t = torch.tensor(targets), torch.tensor(weights)
    head = model.get_output_embeddings()

    def floor():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = head(hidden[rows_t, cols_t])
        logp = logits.gather(-1, targets_t[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        loss = -(weights_t * logp).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    t_floor = best_of(floor, repeats)
    return tokens / t_grpo, tokens / t_no_entropy, tokens / t_floor, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--engine-prompts", type=int, default=16)
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

    engine, seeded, generate, n = bench_engine(model_path, tokenizer, prompts[: args.engine_prompts],
                                               args.max_tokens, args.repeats)
    print(f"engine   transformers generate {generate:8.1f} tok/s   ({n} tokens, {args.engine_prompts} prompts, "
          "sampled, no stop)")
    print(f"engine   astuner HF engine     {engine:8.1f} tok/s   {100 * (engine / generate - 1):+.1f}% vs generate "
          "(also records logprobs)")
    print(f"engine   ... seed per request  {seeded:8.1f} tok/s   {100 * (seeded / generate - 1):+.1f}% vs generate")

    raw, flow, n = bench_rollout(model_path, tokenizer, prompts, args.max_tokens, args.repeats)
    print(f"rollout  raw engine generate   {raw:8.1f} tok/s   ({n} tokens, {args.prompts} prompts, greedy)")
    print(f"rollout  workflow + ModelTuner {flow:8.1f} tok/s   {100 * (flow / raw - 1):+.1f}% vs raw")

    samples = make_samples(tokenizer, prompts[: args.train_samples], args.response_len)
    grpo, no_entropy, floor, n = bench_train(model_path, samples, args.repeats, args.budget)
    print(f"train    hand-written step     {floor:8.1f} tok/s   ({n} tokens, {len(samples)} samples; response-only "
          "LM head, logsumexp)")
    print(f"train    astuner GRPO step     {grpo:8.1f} tok/s   {100 * (grpo / floor - 1):+.1f}% vs floor")
    print(f"train    ... without entropy   {no_entropy:8.1f} tok/s   {100 * (no_entropy / floor - 1):+.1f}% vs floor "
          f"(the entropy metric costs {100 * (1 - grpo / no_entropy):.1f}%)")


if __name__ == "__main__":
    main()
