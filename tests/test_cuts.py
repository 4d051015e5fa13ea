"""The truncation ledger (astuner/cuts.py): each limit's cut labelled apart, counted, and treated as rollout.on_cut
says, in the tuner, the rollout and the samples."""

from __future__ import annotations

import asyncio

import pytest

from astuner import cuts
from astuner.algorithm.samples import episodes_to_samples
from astuner.model_tuner import ChatRenderer, EpisodeOverflow, ModelTuner, TunerLimits, get_tool_parser
from astuner.model_tuner.turn import CallOptions
from astuner.monitor.metrics import episode_metrics, pipeline_metrics, validation_metrics
from astuner.rollout import RolloutRunner
from astuner.types import FLAG_CUT_DROPPED, Episode, GenerateResult, LLMCall, Task
from test_rollout import Chatty, ContainsFourJudge, settings

WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


class LengthEngine:
    """Says `text` (then eos); stops for length, as vLLM does, when max_tokens comes first."""

    def __init__(self, tokenizer, text: str = WORDS) -> None:
        self.tokenizer, self.text = tokenizer, text
        self.samplings = []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.samplings.append(sampling)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "length" if len(ids) > sampling.max_tokens else "stop"
        ids = ids[: sampling.max_tokens]
        return GenerateResult(ids, [-0.5] * len(ids), finish)

    def abort(self, request_id):
        pass


def tuner_with(tokenizer, text=WORDS, **limits):
    base = dict(max_model_len=4096, max_tokens_per_turn=64, max_response_tokens=1000, max_prompt_length=2048)
    engine = LengthEngine(tokenizer, text)
    tuner = ModelTuner(engine=engine, tokenizer=tokenizer, renderer=ChatRenderer(tokenizer),
                       tool_parser=get_tool_parser("hermes"), limits=TunerLimits(**{**base, **limits}),
                       temperature=0.7, stop_token_ids=(tokenizer.eos_token_id,))
    return tuner, engine


def talk(tuner, options=None, content="Talk."):
    return asyncio.run(tuner.complete([{"role": "user", "content": content}], None, options))


def test_binding_limit_names_the_scarcest_and_ties_go_to_window_then_budget():
    assert cuts.binding_limit(turn_cap=8, room=100, budget_left=100) == "turn_cap"
    assert cuts.binding_limit(turn_cap=8, room=5, budget_left=100) == "window"
    assert cuts.binding_limit(turn_cap=8, room=100, budget_left=3) == "budget"
    assert cuts.binding_limit(turn_cap=8, room=8, budget_left=8) == "window"
    assert cuts.binding_limit(turn_cap=8, room=9, budget_left=8) == "budget"
    assert cuts.call_cut("length", 8, 8, "turn_cap") == "turn_cap"
    assert cuts.call_cut("stop", 8, 8, "turn_cap") == ""  # an eos at the very last token is no cut
    assert cuts.call_cut("length", 3, 8, "turn_cap") == ""  # a stop string's cut, not a limit's


def test_each_limit_labels_its_own_cut(demo_tokenizer):
    tuner, _ = tuner_with(demo_tokenizer, max_tokens_per_turn=6)
    talk(tuner)
    assert tuner.calls[-1].cut == "turn_cap" and tuner.calls[-1].finish_reason == "length"

    # The budget: 6 + 4 tokens, the second call cut by what the first left, the third refused.
    tuner, engine = tuner_with(demo_tokenizer, max_tokens_per_turn=6, max_response_tokens=10)
    talk(tuner), talk(tuner)
    assert [s.max_tokens for s in engine.samplings] == [6, 4]
    assert [c.cut for c in tuner.calls] == ["turn_cap", "budget"]
    with pytest.raises(EpisodeOverflow):
        talk(tuner)
    assert tuner.overflow_limit == "budget"

    # The window: 5 tokens of room under a turn cap of 64; a longer prompt then finds none.
    prompt_len = len(ChatRenderer(demo_tokenizer).render([{"role": "user", "content": "Talk."}]))
    tuner, _ = tuner_with(demo_tokenizer, max_model_len=prompt_len + 5)
    talk(tuner)
    assert tuner.calls[-1].cut == "window"
    with pytest.raises(EpisodeOverflow):
        talk(tuner, content="Talk for a good deal longer than before, please.")
    assert tuner.overflow_limit == "window"

    tuner, _ = tuner_with(demo_tokenizer, max_prompt_length=3)
    with pytest.raises(EpisodeOverflow):
        talk(tuner)
    assert tuner.overflow_limit == "prompt"

    # The agent's own max_tokens is its choice, labelled apart; an answer that ends by itself is no cut.
    tuner, _ = tuner_with(demo_tokenizer)
    talk(tuner, CallOptions(max_tokens=3))
    assert tuner.calls[-1].cut == "max_tokens"
    tuner, _ = tuner_with(demo_tokenizer, text="Four.")
    talk(tuner)
    assert tuner.calls[-1].cut == "" and not tuner.overflowed


def call(cut: str = "", prompt=(1, 2), response=(3, 4)) -> LLMCall:
    return LLMCall(list(prompt), list(response), [-0.1] * len(response), "length" if cut else "stop", 1.0, cut=cut)


def episode(uid: str, calls: list[LLMCall], reward: float, cut: str = "") -> Episode:
    return Episode(Task("t", "q"), 0, uid, calls=calls, reward=reward, flags=["overflow"] if cut else [], cut=cut)


def batch() -> list[Episode]:
    return [episode("a", [call(), call("turn_cap")], 1.0), episode("b", [call()], 0.0, cut="budget"),
            episode("c", [call(), call("max_tokens")], 0.5), episode("d", [call("window")], 0.0, cut="window")]


@pytest.mark.parametrize("policy, trained, masked", [
    ("train", ["a", "b", "c", "d"], []),
    ("mask", ["a", "c"], [("a", 1), ("d", 0)]),
    ("drop", ["c"], []),
])
def test_on_cut_decides_what_trains(policy, trained, masked):
    episodes = batch()
    for e in episodes:
        cuts.apply_policy(e, policy)
    assert [e.episode_uid for e in episodes if e.trainable] == trained
    assert [(e.episode_uid, i) for e in episodes for i, c in enumerate(e.calls) if not c.trainable] == masked
    assert all(FLAG_CUT_DROPPED not in e.flags for e in episodes if e.trainable)
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=4)
    held = {(s.episode_uid, s.call_indices[0]) for s in samples}
    assert held == {(e.episode_uid, i) for e in episodes if e.trainable for i, c in enumerate(e.calls)
                    if c.trainable}


def test_cuts_are_counted_per_limit_once_per_episode():
    episodes = batch()
    episodes[0].calls.append(call("turn_cap"))  # a second turn-cap cut in the same episode counts once
    for e in episodes:
        cuts.apply_policy(e, "mask")
    m = {**pipeline_metrics(episodes, {}), **episode_metrics(episodes, "train")}
    assert {k: m[f"rollout/cut/{k}"] for k in ("turn_cap", "budget", "window", "prompt", "max_tokens", "dropped")} \
        == {"turn_cap": 1.0, "budget": 1.0, "window": 1.0, "prompt": 0.0, "max_tokens": 1.0, "dropped": 2.0}
    assert m["train/overflow_rate"] == 0.5
    assert validation_metrics(episodes, [], 1)["val/cut/window"] == 1.0  # validation episodes are counted apart


@pytest.mark.parametrize("validation", [False, True])
def test_the_rollout_records_the_refusing_limit_and_applies_on_cut_to_training_only(demo_tokenizer, validation):
    limits = TunerLimits(max_model_len=4096, max_tokens_per_turn=6, max_response_tokens=15, max_prompt_length=512)
    runner = RolloutRunner(settings(limits=limits, on_cut="drop", num_repeat=1), LengthEngine(demo_tokenizer),
                           demo_tokenizer, Chatty, ContainsFourJudge(None), (demo_tokenizer.eos_token_id,))
    [e] = runner.run([Task("t1", "count")], validation=validation)
    assert e.cut == "budget" and "overflow" in e.flags
    assert [c.cut for c in e.calls] == ["turn_cap", "turn_cap", "budget"]
    assert (FLAG_CUT_DROPPED in e.flags) is not validation and e.trainable is validation


def test_the_log_viewer_shows_each_cut_as_a_badge():
    from astuner.logview.records import episode_records

    [a, b, *_] = episode_records(batch(), None, None)
    assert [c["flags"] for c in a["calls"]] == [[], ["cut: turn_cap"]]
    assert b["flags"] == ["overflow", "cut: budget"]


def test_a_masked_call_inside_a_merged_sample_is_masked_token_by_token():
    first = call(prompt=(1, 2), response=(3, 4))
    cut = call("turn_cap", prompt=(1, 2, 3, 4, 9), response=(5, 6, 7))
    last = call(prompt=(1, 2, 3, 4, 9, 5, 6, 7, 9), response=(8,))
    ep = episode("m", [first, cut, last], 1.0)
    cuts.apply_policy(ep, "mask")
    other = episode("n", [call()], 0.0)
    [s, _] = episodes_to_samples([ep, other], adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                 max_sample_per_task=4, sample_mode="merge")
    assert s.response_ids == [3, 4, 9, 5, 6, 7, 9, 8]
    assert s.loss_mask == [1, 1, 0, 0, 0, 0, 0, 1]


def test_a_step_whose_episodes_were_all_cut_is_not_called_a_failure(caplog):
    from types import SimpleNamespace

    from astuner.errors import TrainingStalled
    from astuner.selection import Plain

    state = SimpleNamespace(first_error=None, first_error_source=None)
    cut = [episode("a", [call("window")], 0.0, cut="window"), episode("b", [call("turn_cap")], 1.0)]
    for e in cut:
        cuts.apply_policy(e, "drop")
    Plain._stop_if_all_failed(cut, state, 3)  # nothing to train, but the idle-step rule decides, not a stall
    assert "2 of 2 episodes were cut" in caplog.text
    failed = [episode("c", [call()], 0.0)]
    failed[0].flags.append("failed")
    with pytest.raises(TrainingStalled, match="failed or timed out"):
        Plain._stop_if_all_failed(failed, state, 4)
