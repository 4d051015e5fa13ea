"""Context policies (model_tuner/context.py): a conversation longer than the window is compacted, the model sees
exact recorded tokens, each compaction starts a segment, and a summary is a trained call with the episode's
advantage."""

from __future__ import annotations

import asyncio
import json

import pytest

from astuner.algorithm.samples import episodes_to_samples
from astuner.cuts import context_metrics
from astuner.model_tuner import ChatRenderer, EpisodeOverflow, ModelTuner, TunerLimits, get_tool_parser
from astuner.model_tuner.context import DROPPED, SUBAGENT_HEADER, SUBAGENT_REQUEST, SUMMARY_HEADER, SUMMARY_REQUEST
from astuner.types import Episode, GenerateResult, Task

TOOLS = [{"type": "function", "function": {"name": "read_log", "description": "Read a page of the log.",
                                           "parameters": {"type": "object", "properties": {
                                               "page": {"type": "integer"}}, "required": ["page"]}}}]
SUMMARY = "Pages 1 and 2 read: no error yet. Next: page 3."
REPORT = "Page 1: sessions opened, no error."


class RuleEngine:
    """Writes SUMMARY when asked for a summary, REPORT when a sub-agent is asked to read a tool output, else a tool
    call; records each prompt."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.prompts = tokenizer, []

    async def generate(self, prompt_ids, sampling, request_id=None):
        await asyncio.sleep(0)  # an engine answers later: other calls of the episode run meanwhile
        self.prompts.append(list(prompt_ids))
        asked = SUMMARY_REQUEST[:40] in self.tokenizer.decode(prompt_ids)
        text = SUMMARY if asked else '<tool_call>\n{"name": "read_log", "arguments": {"page": 3}}\n</tool_call>'
        if SUBAGENT_REQUEST[:40] in self.tokenizer.decode(prompt_ids):
            text = REPORT
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "length" if len(ids) > sampling.max_tokens else "stop"  # as vLLM: cut at max_tokens, no eos
        ids = ids[: sampling.max_tokens]
        return GenerateResult(ids, [-0.25] * len(ids), finish)

    def abort(self, request_id):
        pass


def tuner_for(tokenizer, policy: str, window: int, per_turn: int = 64, engine_cls=None, summary_tokens=48):
    engine = (engine_cls or RuleEngine)(tokenizer)
    limits = TunerLimits(max_model_len=window, max_tokens_per_turn=per_turn, max_response_tokens=4000,
                         max_prompt_length=4000, context_policy=policy, summary_max_tokens=summary_tokens)
    tuner = ModelTuner(engine=engine, tokenizer=tokenizer, renderer=ChatRenderer(tokenizer),
                       tool_parser=get_tool_parser("hermes"), limits=limits, temperature=1.0,
                       stop_token_ids=(tokenizer.eos_token_id,))
    return tuner, engine


def page(n: int) -> str:
    return " ".join(f"line{n}-{i} ok" for i in range(60))  # a few hundred tokens


def history(tuner, pages: int) -> list[dict]:
    """The agent's own messages: the task, then per page a tool call answered by the model and its result."""
    messages = [{"role": "system", "content": "You read logs."}, {"role": "user", "content": "Find the error."}]
    for n in range(1, pages + 1):
        reply = asyncio.run(tuner.chat(messages, TOOLS))
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": page(n)}]
    return messages


def window_for(tokenizer, pages: int) -> int:
    """A window that holds the task and `pages` pages, and not one more, with a turn of room."""
    tuner, _ = tuner_for(tokenizer, "none", 100_000)
    messages = history(tuner, pages)
    return len(ChatRenderer(tokenizer).render(messages, TOOLS)) + 64 + 160


def test_without_a_policy_the_window_refuses(demo_tokenizer):
    tuner, _ = tuner_for(demo_tokenizer, "none", window_for(demo_tokenizer, 2))
    messages = history(tuner, 3)
    with pytest.raises(EpisodeOverflow):
        asyncio.run(tuner.chat(messages, TOOLS))
    assert tuner.overflow_limit == "window" and all(c.segment == 0 for c in tuner.calls)


def test_a_summary_length_term_charges_the_summaries_tokens_and_nothing_else(demo_tokenizer):
    """task_judge.shaping->SummaryLengthPenalty: r = -alpha * max(0, S - target), S the summary calls' tokens."""
    from astuner.rollout_episode import judge_output
    from astuner.task_judge.base_judge import FunctionJudge
    from astuner.task_judge.shaping import CombinedJudge, SummaryLengthPenalty
    from astuner.workflow import JudgeOutput, WorkflowOutput, WorkflowTask

    def right(task, response, auxiliary_models):
        return JudgeOutput(reward=1.0, is_success=True)

    short = SummaryLengthPenalty(target=4, alpha=0.25)
    judge = CombinedJudge([("right", 1.0, FunctionJudge(right), True), ("short", 1.0, short, False)])
    tuner, _ = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2))
    asyncio.run(tuner.chat(history(tuner, 3), TOOLS))  # three pages do not fit: a summary, then a call after it
    episode = Episode(Task("t", "q"), 0, "a")
    output = WorkflowOutput(reward=None, metadata={"final_answer": "x"})
    asyncio.run(judge_output(judge, 10.0, episode, WorkflowTask(episode.task), output, tuner))
    summaries = [len(c.response_ids) for c in tuner.calls if c.context == "summary"]
    assert len(summaries) == 1 and summaries[0] > 4 + 8  # SUMMARY's tokens and eos, well past the target
    assert episode.metrics["reward/short"] == -0.25 * (summaries[0] - 4)  # the other calls' tokens not counted
    assert episode.reward == 1.0 - 0.25 * (summaries[0] - 4) and episode.is_success
    without = WorkflowOutput(reward=None, stats={"response_tokens": 900, "summary_tokens": 0})
    assert short.compute_reward(WorkflowTask(episode.task), without) == (0.0, True)  # no summary, no charge


def test_drop_tool_outputs_keeps_the_latest_and_starts_a_segment(demo_tokenizer):
    tuner, engine = tuner_for(demo_tokenizer, "drop_tool_outputs", window_for(demo_tokenizer, 2))
    messages = history(tuner, 3)
    asyncio.run(tuner.chat(messages, TOOLS))  # three pages do not fit: page 1 is dropped
    compacted = tuner.calls[-1]
    assert [c.context for c in tuner.calls] == ["", "", "", "compacted"]
    assert [c.segment for c in tuner.calls] == [0, 0, 0, 1] and compacted.cut == ""
    text = demo_tokenizer.decode(compacted.prompt_ids)
    assert DROPPED.format(n=len(page(1))) in text and page(1) not in text and page(2) in text and page(3) in text
    shown = messages[:3] + [{**messages[3], "content": DROPPED.format(n=len(page(1)))}] + messages[4:]
    assert compacted.prompt_ids == ChatRenderer(demo_tokenizer).render(shown, TOOLS)  # exact recorded tokens

    # The agent goes on with its own full history: the model keeps seeing the compaction, token-exactly.
    reply = asyncio.run(tuner.chat(messages, TOOLS))
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "short"}]
    asyncio.run(tuner.chat(messages, TOOLS))
    assert tuner.calls[-1].extends_previous and tuner.calls[-1].segment == 1 and tuner.calls[-1].context == ""
    assert engine.prompts[-1] == tuner.calls[-1].prompt_ids


def test_summarize_writes_a_trained_summary_and_shows_task_summary_and_latest_turn(demo_tokenizer):
    tuner, engine = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2))
    messages = history(tuner, 3)
    asyncio.run(tuner.chat(messages, TOOLS))  # three pages do not fit: a summary of the first two
    summary, compacted = tuner.calls[-2:]
    assert [c.context for c in tuner.calls] == ["", "", "", "summary", "compacted"]
    assert [c.segment for c in tuner.calls] == [0, 0, 0, 0, 1]
    assert summary.trainable and summary.tools is None and SUMMARY in summary.response_text
    asked = demo_tokenizer.decode(summary.prompt_ids)
    assert SUMMARY_REQUEST in asked and "Find the error." in asked and page(1)[:40] in asked
    # The model sees the task, the summary, then the conversation from the latest assistant turn on.
    shown = messages[:2] + [{"role": "user", "content": SUMMARY_HEADER + SUMMARY}] + messages[-2:]
    assert compacted.prompt_ids == ChatRenderer(demo_tokenizer).render(shown, TOOLS)
    assert engine.prompts[-1] == compacted.prompt_ids

    ep = Episode(Task("t", "q"), 0, "a", calls=list(tuner.calls), reward=1.0)
    other = Episode(Task("t", "q"), 1, "b", calls=list(tuner.calls[:1]), reward=0.0)
    samples = episodes_to_samples([ep, other], adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=8)
    mine = {s.call_indices[0]: s.advantage for s in samples if s.episode_uid == "a"}
    assert sorted(mine) == [0, 1, 2, 3, 4] and set(mine.values()) == {0.5}  # the summary shares it
    metrics = context_metrics([ep], "rollout")
    assert metrics["rollout/context/compactions"] == 1.0
    assert metrics["rollout/context/summary_length"] == len(summary.response_ids)


def test_a_subagent_reads_the_oldest_tool_output_in_a_fresh_context_and_its_report_takes_its_place(demo_tokenizer):
    tuner, engine = tuner_for(demo_tokenizer, "subagent", window_for(demo_tokenizer, 2))
    messages = history(tuner, 3)
    asyncio.run(tuner.chat(messages, TOOLS))  # three pages do not fit: a sub-agent reads page 1
    report, compacted = tuner.calls[-2:]
    assert [c.context for c in tuner.calls] == ["", "", "", "subagent", "compacted"]
    assert [c.segment for c in tuner.calls] == [0, 0, 0, 0, 1]
    assert report.trainable and report.tools is None and REPORT in report.response_text
    # A fresh context: the task and page 1 alone, not the agent's conversation.
    asked = demo_tokenizer.decode(report.prompt_ids)
    assert SUBAGENT_REQUEST in asked and "Find the error." in asked and page(1) in asked
    assert page(2)[:40] not in asked and "read_log" not in asked
    # The model sees its own conversation with page 1 replaced by the report, token-exactly.
    shown = messages[:3] + [{**messages[3], "content": SUBAGENT_HEADER + REPORT}] + messages[4:]
    assert compacted.prompt_ids == ChatRenderer(demo_tokenizer).render(shown, TOOLS)
    assert engine.prompts[-1] == compacted.prompt_ids

    # The agent goes on with its own full history: the report stays in page 1's place; no second sub-agent.
    reply = asyncio.run(tuner.chat(messages, TOOLS))
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "short"}]
    asyncio.run(tuner.chat(messages, TOOLS))
    assert [c.context for c in tuner.calls[5:]] == ["", ""] and tuner.calls[-1].extends_previous
    assert SUBAGENT_HEADER + REPORT in demo_tokenizer.decode(tuner.calls[-1].prompt_ids)

    ep = Episode(Task("t", "q"), 0, "a", calls=list(tuner.calls), reward=1.0)
    other = Episode(Task("t", "q"), 1, "b", calls=list(tuner.calls[:1]), reward=0.0)
    samples = episodes_to_samples([ep, other], adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=8)
    mine = {s.call_indices[0]: s.advantage for s in samples if s.episode_uid == "a"}
    assert 3 in mine and set(mine.values()) == {0.5}  # the sub-agent's call shares the episode's advantage
    metrics = context_metrics([ep], "rollout")
    assert metrics["rollout/context/subagent_calls"] == 1.0 and metrics["rollout/context/compactions"] == 1.0
    assert metrics["rollout/context/subagent_report_length"] == len(report.response_ids)


def test_a_framework_that_compacts_its_own_history_starts_a_segment(demo_tokenizer):
    tuner, _ = tuner_for(demo_tokenizer, "none", 100_000)
    messages = history(tuner, 2)
    own = messages[:2] + [{"role": "user", "content": "Earlier: two pages read."}]  # the framework's summary
    asyncio.run(tuner.chat(own, TOOLS))
    assert [(c.segment, c.context) for c in tuner.calls] == [(0, ""), (0, ""), (1, "reset")]
    assert context_metrics([Episode(Task("t", "q"), 0, "a", calls=tuner.calls)], "r")["r/context/resets"] == 1.0


def test_the_viewer_shows_each_calls_segment_and_context():
    from astuner.logview.records import episode_records
    from astuner.types import LLMCall

    calls = [LLMCall([1], [2], [-0.1], "stop", 1.0, context="summary"),
             LLMCall([1], [2], [-0.1], "stop", 1.0, segment=1, context="compacted")]
    [record] = episode_records([Episode(Task("t", "q"), 0, "a", calls=calls)], None, None)
    assert [c["flags"] for c in record["calls"]] == [["summary"], ["segment 1", "compacted"]]


@pytest.mark.parametrize("policy", ["none", "drop_tool_outputs", "summarize", "subagent"])
def test_the_config_reaches_the_tuner(policy, tmp_path):
    from astuner.config import load_config

    yaml = tmp_path / "x.yaml"
    yaml.write_text(json.dumps({"astuner": {"rollout": {"context_policy": policy, "summary_max_tokens": 32}}}))
    from astuner.rollout import RolloutSettings

    limits = RolloutSettings.from_config(load_config(str(yaml)).typed, 2048).limits
    assert (limits.context_policy, limits.summary_max_tokens) == (policy, 32)


def test_the_latest_tool_output_is_never_dropped(demo_tokenizer):
    tuner, _ = tuner_for(demo_tokenizer, "drop_tool_outputs", 100_000)
    messages = history(tuner, 3)
    # A window the task and the latest page fit in, but not two dropped pages' markers beside it and a turn.
    tuner, _ = tuner_for(demo_tokenizer, "drop_tool_outputs", len(ChatRenderer(demo_tokenizer).render(
        messages[:2] + messages[-2:], TOOLS)) + 64 + 10)
    with pytest.raises(EpisodeOverflow):
        asyncio.run(tuner.chat(messages, TOOLS))
    assert tuner.overflow_limit == "window" and tuner.calls == []


def test_a_second_summary_rolls_up_the_first(demo_tokenizer):
    tuner, engine = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2))
    messages = history(tuner, 5)  # a summary after page 3 (call 4), another after page 5 (call 6)
    asyncio.run(tuner.chat(messages, TOOLS))
    assert [c.context for c in tuner.calls].count("summary") == 2
    assert [c.segment for c in tuner.calls if c.context == "compacted"] == [1, 2]
    second = [c for c in tuner.calls if c.context == "summary"][1]
    assert SUMMARY_HEADER.split("(")[0] in demo_tokenizer.decode(second.prompt_ids)  # the first summary, summarized
    reply = tuner.calls[-1].reply
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "short"}]
    asyncio.run(tuner.chat(messages, TOOLS))
    assert tuner.calls[-1].extends_previous and (tuner.calls[-1].segment, tuner.calls[-1].context) == (2, "")


def test_parallel_calls_of_one_agent_share_one_summary(demo_tokenizer):
    tuner, engine = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2))
    messages = history(tuner, 3)

    async def both():
        return await asyncio.gather(tuner.chat(messages, TOOLS), tuner.chat(messages, TOOLS))

    asyncio.run(both())
    assert [c.context for c in tuner.calls[3:]] == ["summary", "compacted", ""]  # the second waited, then saw it
    assert tuner.calls[4].prompt_ids == tuner.calls[5].prompt_ids and tuner.calls[5].segment == 1


def test_results_the_model_has_not_answered_are_never_dropped():
    from astuner.model_tuner.context import drop_tool_outputs

    view = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "old"}, {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "new a"}, {"role": "tool", "content": "new b"}]
    shown, upto = drop_tool_outputs(view, lambda m: False)  # never fits: the most that may go, goes
    assert [m["content"] for m in shown] == ["task", "", DROPPED.format(n=3), "", "new a", "new b"] and upto == 3


class EmptySummaryEngine(RuleEngine):
    async def generate(self, prompt_ids, sampling, request_id=None):
        if SUMMARY_REQUEST[:40] in self.tokenizer.decode(prompt_ids):
            self.prompts.append(list(prompt_ids))
            ids = self.tokenizer.encode(" " * 3, add_special_tokens=False)[:2] + [self.tokenizer.eos_token_id]
            return GenerateResult(ids, [-0.25] * len(ids), "stop")
        return await super().generate(prompt_ids, sampling, request_id)


def test_an_empty_summary_changes_nothing_and_a_long_one_is_labelled_summary_cap(demo_tokenizer):
    tuner, _ = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2), engine_cls=EmptySummaryEngine)
    messages = history(tuner, 3)
    with pytest.raises(EpisodeOverflow):  # shown as it was: the window refuses it
        asyncio.run(tuner.chat(messages, TOOLS))
    assert tuner.calls[-1].context == "summary" and not tuner.context.compactions

    tuner, _ = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2), summary_tokens=5)  # < SUMMARY
    messages = history(tuner, 3)
    asyncio.run(tuner.chat(messages, TOOLS))
    assert [(c.context, c.cut) for c in tuner.calls[-2:]] == [("summary", "summary_cap"), ("compacted", "")]


class LongSummaryEngine(RuleEngine):
    """A summary of about 60 tokens, longer than the per-turn cap the test sets (a page's call is about 25)."""

    async def generate(self, prompt_ids, sampling, request_id=None):
        if SUMMARY_REQUEST[:40] in self.tokenizer.decode(prompt_ids):
            self.prompts.append(list(prompt_ids))
            self.summary_cap = sampling.max_tokens
            ids = self.tokenizer.encode(SUMMARY * 4, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            finish = "length" if len(ids) > sampling.max_tokens else "stop"
            return GenerateResult(ids[: sampling.max_tokens], [-0.25] * min(len(ids), sampling.max_tokens), finish)
        return await super().generate(prompt_ids, sampling, request_id)


def test_a_summary_is_capped_by_summary_max_tokens_not_by_the_per_turn_cap(demo_tokenizer):
    """summary_max_tokens above the per-turn cap: the summary has its own cap, and is whole."""
    tuner, engine = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2), per_turn=32,
                              engine_cls=LongSummaryEngine, summary_tokens=96)
    assert len(demo_tokenizer.encode(SUMMARY * 4, add_special_tokens=False)) > 32
    asyncio.run(tuner.chat(history(tuner, 3), TOOLS))
    summary = next(c for c in tuner.calls if c.context == "summary")
    assert engine.summary_cap == 96 and summary.cut == "" and summary.response_text.strip() == (SUMMARY * 4).strip()
    assert all(c.cut == "" for c in tuner.calls)


def test_an_agent_on_the_openai_endpoint_is_compacted_the_same_way(demo_tokenizer):
    from astuner.model_tuner.frontends.gateway import Gateway

    tuner, _ = tuner_for(demo_tokenizer, "summarize", window_for(demo_tokenizer, 2))
    tuner.gateway = Gateway()

    async def agent():
        client = tuner.get_openai_client()
        messages = [{"role": "system", "content": "You read logs."}, {"role": "user", "content": "Find the error."}]
        for n in range(1, 5):
            reply = (await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)).choices[0]
            messages += [reply.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": reply.message.tool_calls[0].id, "content": page(n)}]

    try:
        asyncio.run(agent())
    finally:
        tuner.gateway.close()
    assert [c.context for c in tuner.calls] == ["", "", "", "summary", "compacted"]
    assert SUMMARY_HEADER.split("(")[0] in demo_tokenizer.decode(tuner.calls[-1].prompt_ids)


def compacted_episode() -> Episode:
    """Calls of one agent: a plain call, a summary, the call first shown it (segment 1), then a sub-agent's report
    and the call shown it (segment 2), and a call of another agent between them."""
    from astuner.types import LLMCall

    def call(segment=0, context="", agent="reader"):
        return LLMCall([1, 2], [3], [-0.1], "stop", 1.0, agent=agent, segment=segment, context=context)

    return Episode(Task("t", "q"), 0, "a", calls=[
        call(), call(0, "summary"), call(1, "compacted"), call(agent="helper"), call(1, "subagent"),
        call(2, "compacted"), call(2)])


def test_the_viewer_links_a_context_policys_calls_to_the_call_shown_their_work(tmp_path):
    import sqlite3

    from astuner.logview import store
    from astuner.logview.records import episode_records

    writer = store.StepWriter(tmp_path)
    writer.write("train", 1, episode_records([compacted_episode()], None, None))
    writer.close()
    ep = store.episode(store.connect(tmp_path / store.FILE_NAME, readonly=True), 1)
    calls = ep["calls"]
    assert [(c["segment"], c["context"]) for c in calls] == [
        (0, ""), (0, "summary"), (1, "compacted"), (0, ""), (1, "subagent"), (2, "compacted"), (2, "")]
    assert [c["shown_in"] for c in calls] == [None, 2, None, None, 5, None, None]
    assert [c["made_by"] for c in calls] == [[], [], [1], [], [], [4], []]

    # A store written before the columns existed reads segment 0 and no context, unlinked.
    old = tmp_path / "old"
    old.mkdir()
    with sqlite3.connect(old / store.FILE_NAME) as conn:
        conn.executescript(store.SCHEMA.replace(" model TEXT,\n    segment INTEGER, context TEXT,", ""))
        conn.execute("INSERT INTO episodes (id, split, step, idx, flags, output) VALUES (1, 'train', 1, 0, '[]', '{}')")
        conn.execute("INSERT INTO calls (episode_id, idx, agent, trainable, messages, flags, tokens) "
                     "VALUES (1, 0, '', 1, '[]', '[]', '{}')")
    store.StepWriter(old, resume_step=1).close()  # a resumed run continues the old store
    [call] = store.episode(store.connect(old / store.FILE_NAME, readonly=True), 1)["calls"]
    assert (call["segment"], call["context"], call["shown_in"], call["made_by"]) == (0, "", None, [])
