"""The long-horizon tutorial's warm start (tutorial/long_horizon/make_demos.py) demonstrates what a summarizing
rollout shows the model: an engine that plays a demonstrated episode through a real ModelTuner, at the tutorial's
window, turn cap and summary cap, is compacted where the demonstration says (after the call for page 4), and each
demonstrated row is exactly a recorded call's prompt and response."""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
from types import SimpleNamespace

import pytest

from astuner.model_tuner import ChatRenderer, ModelTuner, TunerLimits, get_tool_parser
from astuner.types import GenerateResult

from conftest import REPO

sys.path.insert(0, str(REPO / "tutorial" / "long_horizon"))
import make_demos  # noqa: E402
import log_task  # noqa: E402


class Player:
    """Answers each call with the next assistant message of a demonstrated episode's rows, in order."""

    def __init__(self, tokenizer, replies: list[dict]) -> None:
        self.tokenizer, self.replies = tokenizer, list(replies)

    async def generate(self, prompt_ids, sampling, request_id=None):
        await asyncio.sleep(0)
        reply = self.replies.pop(0)
        text = reply["content"]
        for call in reply.get("tool_calls") or []:
            body = {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
            text += f"<tool_call>\n{json.dumps(body)}\n</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens - 1]
        return GenerateResult(ids + [self.tokenizer.eos_token_id], [-0.5] * (len(ids) + 1), "stop")

    def abort(self, request_id):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("twin", (*make_demos.TWINS, make_demos.LOG), ids=lambda twin: twin.tool)
@pytest.mark.parametrize("seed,pages", [(0, 5), (3, 4)])
def test_a_demonstrated_episode_is_what_a_summarizing_rollout_records(twin, seed, pages, demo_tokenizer):
    if twin is make_demos.LOG:  # the log's own episodes: the prompts and tool of log_task's agent
        reading, summarizing, after = make_demos.log_episode(make_demos.LOG_SEED + seed, pages)
        assert reading["messages"][0]["content"] == log_task.SYSTEM and reading["tools"] == [log_task.READ_LOG]
    else:
        reading, summarizing, after = make_demos.episode(random.Random(seed), twin)
    assert f"this {twin.record} of {pages} pages" in reading["messages"][1]["content"]
    tools = reading["tools"]
    config = (REPO / "tutorial" / "long_horizon" / "long_horizon.yaml").read_text()
    assert "max_model_len: 2048" in config and "max_response_length_in_one_turn: 128" in config
    assert "summary_max_tokens: 192" in config
    replies = [m for row in (reading, summarizing, after) for m in row["messages"] if m["role"] == "assistant"]
    del replies[5]  # after pages 1-4's calls and the summary: the call for page 4, shown again after the summary
    limits = TunerLimits(max_model_len=2048, max_tokens_per_turn=128, max_response_tokens=100_000,
                         max_prompt_length=100_000, context_policy="summarize", summary_max_tokens=192)
    tuner = ModelTuner(engine=Player(demo_tokenizer, replies), tokenizer=demo_tokenizer,
                       renderer=ChatRenderer(demo_tokenizer), tool_parser=get_tool_parser("hermes"), limits=limits,
                       temperature=1.0, stop_token_ids=(demo_tokenizer.eos_token_id,))
    pages = {m["tool_call_id"]: m["content"] for row in (reading, after) for m in row["messages"]
             if m["role"] == "tool"}
    messages = reading["messages"][:2]
    while True:  # the agent: its own full history, each call's result appended
        reply = asyncio.run(tuner.chat(messages, tools))
        messages.append(reply)
        if not reply.get("tool_calls"):
            break
        n = json.loads(reply["tool_calls"][0]["function"]["arguments"])["page"]
        messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": pages[f"call_{n}"]})

    renderer = ChatRenderer(demo_tokenizer)
    contexts = [c.context for c in tuner.calls]
    assert contexts[:5] == ["", "", "", "", "summary"] and contexts[5] == "compacted"
    page4, summary, last = tuner.calls[3], tuner.calls[4], tuner.calls[-1]
    assert page4.prompt_ids == renderer.render(reading["messages"][:-1], tools)
    assert summary.prompt_ids == renderer.render(summarizing["messages"][:-1], None)
    assert summary.response_text.strip() == summarizing["messages"][-1]["content"]
    assert last.prompt_ids == renderer.render(after["messages"][:-1], tools)
    # The log task's judge reads the twins' answer: the name and the key line's time.
    assert log_task.parse_answer(last.response_text) == log_task.parse_answer(after["messages"][-1]["content"])
    assert log_task.parse_answer(last.response_text).count(":") == 1


def test_the_log_is_demonstrated_on_logs_no_task_uses_and_its_twins_never_name_it():
    rows = make_demos.demonstrations(8)
    episodes = [rows[i:i + 3] for i in range(0, len(rows), 3)]
    log = [e for e in episodes if e[0]["tools"] == [log_task.READ_LOG]]
    assert len(episodes) == 8 and len(log) == 2
    text = json.dumps(rows)
    assert all(twin.tool in text for twin in make_demos.TWINS)
    tasks = [json.loads(line) for name in ("train", "val")
             for line in (REPO / "tutorial" / "long_horizon" / "logs" / f"{name}.jsonl").read_text().splitlines()]
    used = {log_task.make_log(t["seed"], t["pages"])[0][0] for t in tasks}  # every task's first page
    assert not any(e[0]["messages"][3]["content"].split("\n", 1)[1] in used for e in log)
    twins = json.dumps([e for e in episodes if e not in log])
    for word in ("read_log", "user=", "session=", "ERROR", *log_task.USERS, *log_task.SERVICES):
        assert not re.search(rf"\b{word}\b", twins), word


def test_the_log_judge_wants_the_user_and_the_time_of_the_failure():
    """A name from the first page alone earns half at most (the shortcut GRPO learnt when it earned everything):
    the other half is the failure's time, which only the last page has; a success is both."""
    pages, answer = log_task.make_log(7, 5)
    user, time = answer.split()
    failure = next(line for line in pages[-1].splitlines() if " ERROR " in line)
    assert failure.startswith(time + ":") and f"user={user} " in pages[0]
    assert not any(line.startswith(time + ":") for page in pages[:-1] for line in page.splitlines())
    task = SimpleNamespace(task=SimpleNamespace(metadata={"answer": answer}))

    def reward(text):
        return log_task.UserJudge().compute_reward(task, SimpleNamespace(metadata={"final_answer": text}))

    hours, minutes = time.split(":")
    assert reward(f"It was {user}. \\boxed{{{user} {time}}}") == (1.0, True)
    assert reward(f"\\boxed{{{user.title()}, at {time}:59}}") == (1.0, True)
    assert reward(f"\\boxed{{{user}}}") == (0.0, False)  # a name alone is not an answer
    assert reward(f"\\boxed{{{user} {hours}:{(int(minutes) + 1) % 60:02d}}}") == (0.5, False)
    assert reward(f"\\boxed{{nobody {time}}}") == (0.5, False)
    assert reward("no box") == (0.0, False)
