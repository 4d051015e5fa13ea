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
@pytest.mark.parametrize("twin", make_demos.TWINS, ids=lambda twin: twin.tool)
@pytest.mark.parametrize("seed,pages", [(0, 5), (3, 4)])
def test_a_demonstrated_episode_is_what_a_summarizing_rollout_records(twin, seed, pages, demo_tokenizer):
    reading, summarizing, after = make_demos.episode(random.Random(seed), twin)
    assert f"this {twin.record} of {pages} pages" in reading["messages"][1]["content"]
    tools = [twin.schema()]
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
    assert log_task.BOXED.findall(last.response_text)


def test_the_demonstrations_never_name_the_log_task():
    rows = make_demos.demonstrations(8)
    text = json.dumps(rows)
    assert len(rows) == 24 and all(twin.tool in text for twin in make_demos.TWINS)
    for word in ("read_log", "user=", "session=", "ERROR", *log_task.USERS, *log_task.SERVICES):
        assert not re.search(rf"\b{word}\b", text), word
