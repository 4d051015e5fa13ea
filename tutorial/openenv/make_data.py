"""Writes demonstrations of calc_env's tools for a supervised warm start, played through the environment itself.

data/sft_train.jsonl   16 episodes: the reset's question, a call of `add` with its two numbers, the tool's result,
                       a call of `submit_answer` with it (each checked: the environment rewards it 1)
data/sft_val.jsonl     16 others, for the validation loss

Each conversation is rendered as astuner's OpenEnv workflow renders an episode (its observation and tool-result
text, the tools as the environment lists them), under reset seeds far from the training and validation ones.
Run: python tutorial/openenv/make_data.py
"""

import json
import re
import tempfile
from pathlib import Path

from openenv.core import GenericEnvClient

from astuner.environments.openenv import observation_text, openai_tools, tool_result_text
from astuner.environments.openenv_servers import AppSpec, LocalServer

HERE = Path(__file__).parent
FIRST_SEED = 50_000_000  # training seeds start at astuner.seed, validation ones 1_000_003 later


def call(name: str, arguments: dict, index: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{index}", "type": "function", "function": {
        "name": name, "arguments": json.dumps(arguments)}}]}


def episode(env, seed: int) -> dict:
    reset = env.reset(seed=seed)
    tools = openai_tools(env.step({"type": "list_tools"}).observation["tools"])
    question = observation_text(reset.observation, reset.metadata)
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)", question)[0])
    added = env.step({"type": "call_tool", "tool_name": "add", "arguments": {"a": a, "b": b}})
    total = int(tool_result_text(added.observation))
    submitted = env.step({"type": "call_tool", "tool_name": "submit_answer", "arguments": {"answer": total}})
    assert submitted.done and submitted.reward == 1.0, f"seed {seed}: the environment did not reward the answer"
    messages = [{"role": "user", "content": question}, call("add", {"a": a, "b": b}, 0),
                {"role": "tool", "tool_call_id": "call_0", "content": tool_result_text(added.observation)},
                call("submit_answer", {"answer": total}, 1)]
    return {"messages": messages, "tools": tools}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    log = Path(tempfile.gettempdir()) / "calc_env_make_data.log"  # the server's output, if it will not start
    server = LocalServer(AppSpec("server.app:app", str((HERE / "calc_env").resolve())), log)
    server.start()
    try:
        with GenericEnvClient(base_url=server.url).sync() as env:
            rows = [episode(env, FIRST_SEED + i) for i in range(32)]
    finally:
        server.stop()
    write(HERE / "data" / "sft_train.jsonl", rows[:16])
    write(HERE / "data" / "sft_val.jsonl", rows[16:])
    print(f"wrote {len(rows)} demonstrations to {HERE / 'data'}")
