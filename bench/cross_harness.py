"""One checkpoint, several harnesses, one number: `astuner eval`, reasoning-gym's own scorer loop, verifiers' own
rollout and scoring, and inspect-ai, the last three pointed at `astuner serve-model`.

    python bench/cross_harness.py [--conf tutorial/reasoning_gym/reasoning_gym.yaml] [--model DIR] [--n 64]
        [--inspect-python /path/to/venv/bin/python]  # a Python with inspect-ai installed (its own venv)
        [--verifiers-python .venv-vf/bin/python]     # verifiers' own rollout and scoring of the same questions

Prints one row per harness: greedy accuracy over the config's validation tasks, and how many replies are the same
text as `astuner eval`'s (reasoning-gym loop, inspect-ai). The harnesses send their requests one at a time, as
`astuner eval` runs them here (rollout.max_env_worker=1): a batch of another make-up may round differently on the
engine, which would say nothing about the server.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def astuner_eval(conf: str, overrides: list[str], out: Path) -> tuple[float, dict, dict]:
    from astuner.cli import main

    assert main(["eval", "--conf", conf, "--num-repeat", "0", "--out", str(out), *overrides]) == 0
    with open(out / "eval_tasks.csv") as f:
        rewards = {r["task_id"]: float(r["greedy_reward"]) for r in csv.DictReader(f)}
    store = sqlite3.connect(next((out / "episodes").glob("*/logview.sqlite")))
    replies = dict(store.execute("SELECT e.task_id, c.response_text FROM episodes e JOIN calls c "
                                 "ON c.episode_id = e.id WHERE e.split = 'greedy'").fetchall())
    return sum(r >= 1.0 for r in rewards.values()) / len(rewards), rewards, replies


def start_server(conf: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    from test_serve_model import _start

    return _start(["--conf", conf, "--port", "0", "--key-env", "SERVE_KEY", *overrides],
                  {**os.environ, "SERVE_KEY": "bench-key"})


def reasoning_gym_loop(base_url: str, spec: dict, n: int, max_tokens: int, answer_from: str):
    """reasoning-gym's README loop: its dataset, a model call per question, its `score_answer`."""
    import openai
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    from astuner.task_reader.reasoning_gym_reader import extract

    data = CompositeDataset(CompositeConfig(size=n, seed=spec["seed"], datasets=[
        DatasetSpec(d["name"], d["weight"], d["config"]) for d in spec["datasets"]]))
    client = openai.OpenAI(base_url=base_url, api_key="bench-key", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    replies, rewards = {}, {}
    for i, entry in enumerate(data):
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, messages=[
            {"role": "user", "content": entry["question"]}]).choices[0].message.content
        replies[f"validation-{i}"] = reply
        rewards[f"validation-{i}"] = data.score_answer(extract(reply, answer_from, "answer"), entry)
    return sum(r >= 1.0 for r in rewards.values()) / n, rewards, replies


INSPECT_TASK = textwrap.dedent('''
    import json, re, sys
    from inspect_ai import Task, eval as inspect_eval, task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import CORRECT, INCORRECT, Score, accuracy, scorer
    from inspect_ai.solver import generate

    rows = json.load(open(sys.argv[1]))

    @scorer(metrics=[accuracy()])
    def last_number():
        async def score(state, target):
            numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", state.output.completion)
            ok = bool(numbers) and float(numbers[-1]) == float(target.text)
            return Score(value=CORRECT if ok else INCORRECT, answer=state.output.completion)
        return score

    @task
    def chain_sum():
        return Task(dataset=[Sample(input=r["question"], target=r["answer"], id=r["id"]) for r in rows],
                    solver=generate(), scorer=last_number())

    log, = inspect_eval(chain_sum(), model="openai-api/astuner/" + sys.argv[2], max_connections=1,
                        temperature=0, max_tokens=int(sys.argv[3]), log_dir=sys.argv[4], display="none")
    out = {s.id: s.output.completion for s in log.samples}
    print("INSPECT " + json.dumps({"accuracy": log.results.scores[0].metrics["accuracy"].value, "replies": out}))
''')


def inspect_ai(python: str, base_url: str, model: str, rows: list[dict], max_tokens: int, work: Path):
    (work / "rows.json").write_text(json.dumps(rows))
    (work / "inspect_task.py").write_text(INSPECT_TASK)
    env = {**os.environ, "ASTUNER_BASE_URL": base_url, "ASTUNER_API_KEY": "bench-key"}
    done = subprocess.run([python, str(work / "inspect_task.py"), str(work / "rows.json"), model, str(max_tokens),
                           str(work / "inspect_logs")], env=env, capture_output=True, text=True, timeout=1800)
    line = [x for x in done.stdout.splitlines() if x.startswith("INSPECT ")]
    if not line:
        raise RuntimeError(f"inspect-ai failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(line[0][len("INSPECT "):])
    return result["accuracy"], result["replies"]


VERIFIERS_TASKSET = textwrap.dedent('''
    """The same questions as a verifiers (v1) environment: a one-call harness and an exact-answer reward."""
    import json, re
    from openai import AsyncOpenAI
    import verifiers.v1 as vf

    class AskHarness(vf.Harness[vf.HarnessConfig]):
        NEEDS_CONTAINER = False

        async def setup(self, runtime):
            return None

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            try:
                await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": data.prompt}])
            finally:
                await client.close()
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    class Row(vf.TaskData):
        answer: str
        row_id: str

    class AskTask(vf.Task[Row]):
        @vf.reward(weight=1.0)
        async def correct(self, trace: vf.Trace) -> float:
            numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", trace.last_reply or "")
            return float(bool(numbers) and float(numbers[-1]) == float(self.data.answer))

    class AskConfig(vf.TasksetConfig):
        rows: str = ""

    class AskTaskset(vf.Taskset[AskTask, AskConfig]):
        def load(self):
            for r in json.load(open(self.config.rows)):
                yield AskTask(Row(prompt=r["question"], answer=r["answer"], row_id=r["id"]), self.config.task)

    __all__ = ["AskTaskset", "AskHarness"]
''')

VERIFIERS_RUN = textwrap.dedent('''
    import asyncio, json, os, sys
    sys.path.insert(0, sys.argv[1])
    import verifiers.v1 as vf

    async def main():
        env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "ask_env", "rows": sys.argv[2]},
                                                         "agent": {"runtime": {"type": "subprocess"}}}))
        ctx = vf.ModelContext(model=sys.argv[3], client=vf.EvalClientConfig(base_url=os.environ["ASTUNER_BASE_URL"],
                              api_key_var="ASTUNER_API_KEY"), sampling=vf.SamplingConfig(temperature=0,
                              max_tokens=int(sys.argv[4])))
        replies, rewards = {}, {}
        for task in env.taskset:
            episode = await env.run_episode(task, ctx)
            trace = episode.traces[0]
            replies[task.data.row_id], rewards[task.data.row_id] = trace.last_reply, trace.reward
        print("VERIFIERS " + json.dumps({"replies": replies, "rewards": rewards}))

    asyncio.run(main())
''')


def verifiers_eval(python: str, base_url: str, model: str, rows: list[dict], max_tokens: int, work: Path):
    """verifiers' own rollout and scoring (`Env.run_episode`) of the same questions, in verifiers' environment."""
    (work / "rows.json").write_text(json.dumps(rows))
    (work / "ask_env.py").write_text(VERIFIERS_TASKSET)
    (work / "run_vf.py").write_text(VERIFIERS_RUN)
    env = {**os.environ, "ASTUNER_BASE_URL": base_url, "ASTUNER_API_KEY": "bench-key"}
    done = subprocess.run([python, str(work / "run_vf.py"), str(work), str(work / "rows.json"), model,
                           str(max_tokens)], env=env, capture_output=True, text=True, timeout=1800)
    line = [x for x in done.stdout.splitlines() if x.startswith("VERIFIERS ")]
    if not line:
        raise RuntimeError(f"verifiers failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(line[0][len("VERIFIERS "):])
    return sum(r >= 1.0 for r in result["rewards"].values()) / len(rows), result["replies"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conf", default=str(REPO / "tutorial" / "reasoning_gym" / "reasoning_gym.yaml"))
    parser.add_argument("--model", default=None, help="a checkpoint (default: the config's model)")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--inspect-python", default=None)
    parser.add_argument("--verifiers-python", default=None, help="a Python with verifiers installed (.venv-vf)")
    args = parser.parse_args()

    from astuner.config import load_config
    from astuner.task_reader.base import VALIDATION_SEED_OFFSET
    from astuner.task_reader.reasoning_gym_reader import composite_spec

    work = Path(tempfile.mkdtemp(prefix="cross-harness-"))
    overrides = [f"astuner.task_reader.reasoning_gym.validation_size={args.n}", f"astuner.rollout.engine={args.engine}",
                 "astuner.rollout.max_env_worker=1", f"astuner.experiment_dir={work / 'run'}"]
    if args.model:
        overrides.append(f"astuner.model.path={args.model}")
    typed = load_config(args.conf, overrides).typed
    section = typed.astuner.task_reader.reasoning_gym
    spec = composite_spec([d.model_dump() for d in section.datasets], args.n, typed.astuner.seed + VALIDATION_SEED_OFFSET)
    max_tokens = typed.astuner.rollout.max_response_length_in_one_turn
    rows = []
    start = time.perf_counter()
    acc_eval, _, eval_replies = astuner_eval(args.conf, overrides, work / "eval")
    table = [("astuner eval", acc_eval, args.n, time.perf_counter() - start)]
    proc, base_url = start_server(args.conf, overrides)
    try:
        start = time.perf_counter()
        acc_rg, _, rg_replies = reasoning_gym_loop(base_url, spec, args.n, max_tokens, section.answer_from)
        same = sum(rg_replies[k] == eval_replies.get(k) for k in rg_replies)
        table.append(("reasoning-gym loop", acc_rg, same, time.perf_counter() - start))
        from astuner.task_reader.reasoning_gym_reader import build_composite

        data = build_composite(spec)
        rows = [{"id": f"validation-{i}", "question": data[i]["question"], "answer": str(data[i]["answer"])}
                for i in range(args.n)]
        import openai

        model = openai.OpenAI(base_url=base_url, api_key="bench-key").models.list().data[0].id
        if args.verifiers_python:
            start = time.perf_counter()
            acc_vf, vf_replies = verifiers_eval(args.verifiers_python, base_url, model, rows, max_tokens, work)
            same = sum(vf_replies[k] == eval_replies.get(k) for k in vf_replies)
            table.append(("verifiers run_episode", acc_vf, same, time.perf_counter() - start))
        if args.inspect_python:
            start = time.perf_counter()
            acc_in, in_replies = inspect_ai(args.inspect_python, base_url, model, rows, max_tokens, work)
            same = sum(in_replies[k] == eval_replies.get(k) for k in in_replies)
            table.append(("inspect-ai", acc_in, same, time.perf_counter() - start))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    print(f"\n{args.n} validation tasks of {args.conf}, model {args.model or typed.astuner.model.path}, "
          f"engine {args.engine}, greedy")
    print(f"{'harness':<22}{'accuracy':>10}{'same reply as eval':>20}{'seconds':>10}")
    for name, acc, same, seconds in table:
        print(f"{name:<22}{acc:>10.3f}{same:>14}/{args.n:<5}{seconds:>10.1f}")


if __name__ == "__main__":
    main()
