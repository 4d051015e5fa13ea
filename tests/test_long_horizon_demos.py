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
@pytest.mark.parametrize("seed", [0, 3])
def test_a_demonstrated_episode_is_what_a_summarizing_rollout_records(twin, seed, demo_tokenizer):
    pages = log_task.PAGES
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
    # The log task's judge reads the twins' answer: the name and the word the key line gives.
    value = re.search(rf"^{twin.key} {twin.thing}=\S+ {twin.attr}=(\w+)$", after["messages"][-1]["content"], re.M)
    assert log_task.parse_answer(last.response_text) == log_task.parse_answer(after["messages"][-1]["content"])
    assert log_task.parse_answer(last.response_text).split()[1] == value.group(1) and value.group(1) in twin.values


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
    for word in ("read_log", "user=", "session=", "ERROR", *log_task.USERS, *log_task.SERVICES, *log_task.REASONS):
        assert not re.search(rf"\b{word}\b", twins), word


def test_the_log_judge_wants_the_user_and_the_reason_of_the_failure():
    """A name from the first page alone earns half at most (the shortcut GRPO learnt when it earned everything):
    the other half is the failure's reason, which only the ERROR line on the last page gives; a success is both."""
    pages, answer = log_task.make_log(7, 5)
    user, reason = answer.split()
    failure = next(line for line in pages[-1].splitlines() if " ERROR " in line)
    session = re.search(rf"session=(\S+) user={user}\n", pages[0]).group(1)
    assert failure.endswith(f" ERROR session={session} reason={reason}")  # each fact after what finds it
    assert sum(" ERROR " in page for page in pages) == 1
    task = SimpleNamespace(task=SimpleNamespace(metadata={"answer": answer}))

    def reward(text):
        return log_task.UserJudge().compute_reward(task, SimpleNamespace(metadata={"final_answer": text}))

    other = next(r for r in log_task.REASONS if r != reason)
    assert reward(f"It was {user}. \\boxed{{{user} {reason}}}") == (1.0, True)
    assert reward(f"\\boxed{{{user.title()}, reason={reason}}}") == (1.0, True)
    assert reward(f"\\boxed{{{user}}}") == (0.0, False)  # a name alone is not an answer
    assert reward(f"\\boxed{{{user} {other}}}") == (0.5, False)
    assert reward(f"\\boxed{{nobody {reason}}}") == (0.5, False)
    assert reward("no box") == (0.0, False)


def test_the_log_is_read_in_order():
    """Pages 1 and 5 alone fit the window: the tool refuses a page past the next unread one, so the failure is
    reached through the middle pages (and the window fills on the way)."""
    pages, _ = log_task.make_log(7, 5)
    read_log = log_task.read_log_tool(pages)
    assert read_log(1).startswith("Page 1 of 5:")
    assert read_log(5) == "Error: the pages are read in order; read page 2 first."
    assert all(read_log(n).startswith(f"Page {n} of 5:") for n in (2, 3, 4, 1, 5))
    assert read_log(6) == "Error: the log has pages 1 to 5." and read_log("x") == "Error: page must be a number."
