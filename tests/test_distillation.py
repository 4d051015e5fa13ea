"""On-policy distillation (astuner/algorithm/distillation.py, astuner/distill/): per-token advantages and the loss
against a by-hand computation, tool tokens masked; a teacher scores each call in the exact context the student saw
(a merged chain once); the top-k term by hand, and lifting a token the student never sampled; a teacher that fails
flags its episode (never a zero); a teacher with another vocabulary stops the run at start (exit 2, naming both); a
run on the debug backbone with a model-folder teacher and one with a server teacher (the top-k term on)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from astuner.algorithm.distillation import (
    distill_advantages, distill_samples, response_slice, sharpen, teacher_chains, token_advantages, topk_rows)
from astuner.algorithm.objective_base import TokenBatch
from astuner.algorithm.objectives import PolicyGradient
from astuner.algorithm.samples import episodes_to_samples
from astuner.cli import main
from astuner.distill.scoring import score_episodes
from astuner.types import FLAG_FAILED, FLAG_TEACHER_FAILED, Episode, LLMCall, PromptLogprobs, Sample, Task
from tests.conftest import serve_in_thread


def call(prompt, response, logprobs=None, agent="", trainable=True) -> LLMCall:
    return LLMCall(list(prompt), list(response), logprobs or [-1.0] * len(response), "stop", 1.0, agent=agent,
                   trainable=trainable)


# --- the math, by hand -------------------------------------------------------------------------------------------

def test_token_advantages_by_hand_with_the_tool_tokens_masked():
    # A_t = m_t * (kl_coef * (q_t - s_t) + reward_weight * A_ep); kl_coef 2, A_ep 2, reward_weight 0.25.
    student, teacher, mask = [-1.0, -2.0, -0.5, -3.0], [-0.5, -9.0, -0.5, -1.0], [1, 0, 1, 1]
    got = distill_advantages(student, teacher, mask, 2.0, 2.0, 0.25)
    assert got == pytest.approx([2 * 0.5 + 0.5, 0.0, 0.0 + 0.5, 2 * 2.0 + 0.5])
    assert distill_advantages(student, teacher, None, 1.0, 5.0, 0.0) == pytest.approx([0.5, -7.0, 0.0, 2.0])


def test_samples_take_token_advantages_and_the_step_reports_the_reverse_kl():
    s = Sample([1, 2], [3, 4, 5], [-1.0, -0.2, -2.0], 1.5, 1.0, "e", loss_mask=[1, 0, 1],
               teacher_logprobs=[-0.5, 0.0, -1.0])
    metrics = distill_samples([s], kl_coef=1.0, reward_weight=0.1)
    assert s.token_advantages == pytest.approx([0.5 + 0.15, 0.0, 1.0 + 0.15])
    assert s.advantage == pytest.approx(0.15)
    # Over the two trained tokens: s - q = -0.5, -1.0.
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.75)
    assert metrics["distill/student_logprob"] == pytest.approx(-1.5)
    assert metrics["distill/teacher_logprob"] == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="without teacher logprobs"):
        distill_samples([Sample([1], [2], [-1.0], 0.0, 1.0, "x")], 1.0, 0.0)


def test_the_policy_loss_takes_each_tokens_own_advantage():
    # At ratio 1 (logprobs = old), the PPO-clip token loss is -A_t, so L = -sum_t w_t A_t and dL/dlogp_t = -w_t A_t.
    s = Sample([7], [1, 2, 3], [-1.0, -2.0, -0.5], 0.0, 1.0, "e", loss_mask=[1, 0, 1],
               token_advantages=[0.5, 0.0, -2.0])
    logp = torch.tensor(s.old_logprobs, requires_grad=True)
    batch = TokenBatch.of([s], [0.25], logp, None, None)
    assert batch.advantages_R.tolist() == [0.5, 0.0, -2.0]
    loss, _ = PolicyGradient(0.2, 0.28).loss(batch)
    assert loss.item() == pytest.approx(-(0.25 * 0.5 + 0.25 * -2.0))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.125, 0.0, 0.5])  # the masked tool token gets no gradient
    assert token_advantages(Sample([1], [2, 3], [0.0, 0.0], 0.7, 1.0, "f")) == [0.7, 0.7]


LN = math.log


def test_the_teachers_topk_rows_are_renormalised_padded_and_masked():
    s = Sample([1], [3, 4, 5], [-1.0] * 3, 0.0, 1.0, "e", loss_mask=[1, 0, 1],
               teacher_topk=[[(7, LN(0.6)), (8, LN(0.2)), (2, LN(0.1))], [(9, LN(0.9))], [(9, LN(0.5))]])
    ids, probs = topk_rows([s], 2)
    assert ids == [[7, 8], [0, 0], [9, 0]]  # the first k; padded with id 0; nothing at the masked tool token
    assert probs == [pytest.approx([0.75, 0.25]), [0.0, 0.0], pytest.approx([1.0, 0.0])]
    with pytest.raises(ValueError, match="top-k at 1 positions"):
        topk_rows([Sample([1], [3, 4], [-1.0] * 2, 0.0, 1.0, "e", teacher_topk=[[(7, -1.0)]])], 2)


def test_the_topk_term_by_hand():
    # KL~_t = sum_k p~_tk (log p~_tk - log pi_S_tk); L = topk_coef * sum_t w_t KL~_t; dL/dlog pi_S_tk = -coef w_t p~_tk
    s = Sample([1], [3, 4, 5], [-1.0] * 3, 0.0, 1.0, "e", loss_mask=[1, 0, 1],
               teacher_topk=[[(7, LN(0.6)), (8, LN(0.2))], [], [(9, LN(0.5))]], token_advantages=[0.0] * 3)
    student = torch.tensor([[LN(0.5), LN(0.25)], [-3.0, -3.0], [LN(0.5), -7.0]], requires_grad=True)
    batch = TokenBatch.of([s], [0.25], torch.tensor(s.old_logprobs), None, None, student)
    loss, stats = PolicyGradient(0.2, 0.28, teacher_topk=2, topk_coef=0.5).loss(batch)
    kl = [0.75 * (LN(0.75) - LN(0.5)) + 0.25 * 0.0, 0.0, 1.0 * (0.0 - LN(0.5))]  # 0.3041, 0, 0.6931
    assert stats["distill_topk_kl"].item() == pytest.approx(sum(kl))
    assert loss.item() == pytest.approx(0.5 * 0.25 * sum(kl))  # the policy part is 0: every advantage is 0
    loss.backward()
    assert student.grad.tolist() == [pytest.approx([-0.5 * 0.25 * 0.75, -0.5 * 0.25 * 0.25]), [0.0, 0.0],
                                     pytest.approx([-0.5 * 0.25, 0.0])]


def test_a_teacher_temperature_sharpens_over_the_top_k_by_hand():
    # tau 0.5: p^2 renormalised over the top k. Row (0.6, 0.2, 0.1): squares 0.36, 0.04, 0.01, Z = 0.41.
    q, rows = sharpen([LN(0.2), LN(0.5), -9.0], [[(7, LN(0.6)), (8, LN(0.2)), (2, LN(0.1))],
                                                 [(9, LN(0.5)), (4, LN(0.5))], []], 0.5)
    assert q == pytest.approx([LN(0.04 / 0.41), LN(0.5), -9.0])  # the row-less (masked) position is kept
    assert [t for t, _ in rows[0]] == [7, 8, 2]
    assert [math.exp(x) for _, x in rows[0]] == pytest.approx([0.36 / 0.41, 0.04 / 0.41, 0.01 / 0.41])
    assert [math.exp(x) for _, x in rows[1]] == pytest.approx([0.5, 0.5]) and rows[2] == []
    # A flatter teacher (tau 2): square roots, renormalised.
    q2, _ = sharpen([LN(0.6)], [[(7, LN(0.6)), (8, LN(0.2))]], 2.0)
    assert q2 == pytest.approx([LN(0.6**0.5 / (0.6**0.5 + 0.2**0.5))])


def test_distillation_at_a_teacher_temperature_trains_on_the_sharpened_teacher():
    # The sampled token 8 (student logprob -1.0): the teacher 0.3 -> 0.09 / (0.09 + 0.36) at tau 0.5.
    s = Sample([1], [8], [-1.0], 0.0, 1.0, "e", teacher_logprobs=[LN(0.3)],
               teacher_topk=[[(7, LN(0.6)), (8, LN(0.3))]])
    metrics = distill_samples([s], kl_coef=1.0, reward_weight=0.0, teacher_temperature=0.5)
    sharp = 0.09 / 0.45
    assert s.token_advantages == pytest.approx([LN(sharp) + 1.0])
    assert metrics["distill/reverse_kl"] == pytest.approx(-1.0 - LN(sharp))
    assert metrics["distill/teacher_topk_mass"] == pytest.approx(0.9)  # the teacher's own, before sharpening
    assert topk_rows([s], 2)[1] == [pytest.approx([0.36 / 0.45, sharp])]  # the top-k term reads it too
    with pytest.raises(ValueError, match="needs the teacher's top k"):
        distill_samples([Sample([1], [8], [-1.0], 0.0, 1.0, "x", teacher_logprobs=[-1.0])], 1.0, 0.0, 0.5)


@pytest.mark.slow
def test_a_runs_teacher_temperature_reaches_the_step(tmp_path, tiny_model_dir, teacher_dir):
    """The config's distill_teacher_temperature is the one the step trains with: the step's reverse KL is to the
    sharpened teacher, not the mean gap to the teacher's own logprobs that the log viewer keeps."""
    from astuner.logview import store

    yaml = write_run(tmp_path, tiny_model_dir, f"{{model: {teacher_dir}}}", steps=1,
                     extra=", distill_topk: 4, distill_teacher_temperature: 0.5")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    conn = store.connect(tmp_path / "out" / store.FILE_NAME, readonly=True)
    gaps = [s - q for item in store.episodes(conn, "train", 1)["items"]
            for c in store.episode(conn, item["id"])["calls"]
            for s, q in zip(c["tokens"]["logprob"], c["tokens"]["teacher_logprob"])]
    raw = sum(gaps) / len(gaps)
    assert abs(rows(tmp_path / "out")[0]["distill/reverse_kl"] - raw) > 0.05, raw


@pytest.mark.slow
def test_the_topk_term_lifts_a_token_the_student_never_sampled(tiny_model_dir, demo_tokenizer):
    """Every advantage 0 (the teacher agrees with each sampled token), the teacher's favourite at the first position
    is the token the student finds least likely: only the top-k term moves it, and it is read from the raw
    distribution (temperature 1, no sampling filter, under which it would be -inf)."""
    from astuner.trainer import Trainer
    from astuner.trainer.settings import TrainerSettings

    trainer = Trainer(str(tiny_model_dir), TrainerSettings(lr=1e-3, loss_agg_mode="token-mean", device="cpu", top_k=5))
    p = demo_tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    r = demo_tokenizer(" Paris", add_special_tokens=False)["input_ids"]

    def raw(ids):
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([p + r[:-1]])).logits[0, len(p) - 1 :].float()
        return torch.log_softmax(logits, -1), [logits[0].argmin().item()] if ids is None else ids

    before, (rare,) = raw(None)
    old = trainer.compute_logprobs(p, r, 0.7)
    top = [[(rare, LN(0.9)), (r[0], LN(0.1))]] + [[(t, -0.1)] for t in r[1:]]

    def sample():
        return Sample(p, r, list(old), 0.0, 0.7, "e", teacher_logprobs=list(old), token_advantages=[0.0] * len(r),
                      teacher_topk=top)

    trainer.model.eval()
    with torch.no_grad():
        _, _, topk_R_K = trainer.forward_logprobs([sample()], topk=2)
    assert topk_R_K[0].tolist() == pytest.approx([before[0, rare].item(), before[0, r[0]].item()], abs=1e-4)
    trainer.train([sample()], PolicyGradient(0.2, 0.28))  # no top-k term: nothing to learn
    assert raw(None)[0][0, rare].item() == pytest.approx(before[0, rare].item(), abs=1e-6)
    trainer.train([sample()], PolicyGradient(0.2, 0.28, teacher_topk=2, topk_coef=1.0))
    assert raw(None)[0][0, rare].item() > before[0, rare].item() + 0.05


def test_a_teacher_scores_the_topk_of_each_calls_positions_and_a_merge_joins_them():
    good = episode("g", "t", [call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6])], 1.0)
    bad = episode("b", "t", [call([1, 2], [3, 666])], 0.0)
    score_episodes(FakeTeacher(poison=666), [good, bad], topk=2)
    rows_of = {t: [(t, -0.01 * t), (t + 1, -0.01 * t - 1)] for t in (3, 4, 6)}  # FakeTeacher's top-2 at token t
    assert good.calls[0].teacher_topk == [rows_of[3], rows_of[4]] and good.calls[1].teacher_topk == [rows_of[6]]
    assert bad.calls[0].teacher_topk is None
    samples = episodes_to_samples([good], adv_estimator="grpo", norm_by_std=True, epsilon=1e-6,
                                  max_sample_per_task=8, sample_mode="merge")
    assert samples[0].teacher_topk == [rows_of[3], rows_of[4], [], rows_of[6]]  # the tool token 5 has none
    ids, probs = topk_rows(samples, 2)
    assert ids == [[3, 4], [4, 5], [0, 0], [6, 7]]
    mass = distill_samples(samples, 1.0, 0.0)["distill/teacher_topk_mass"]  # over the 3 trained tokens
    assert mass == pytest.approx(sum(math.exp(-0.01 * t) + math.exp(-0.01 * t - 1) for t in (3, 4, 6)) / 3)
    assert probs[0] == pytest.approx([1 / (1 + math.exp(-1)), 1 - 1 / (1 + math.exp(-1))])


def test_one_step_moves_the_teachers_favourites_up_and_the_others_down(tiny_model_dir, demo_tokenizer):
    from astuner.trainer import Trainer
    from astuner.trainer.settings import TrainerSettings

    trainer = Trainer(str(tiny_model_dir), TrainerSettings(lr=1e-3, loss_agg_mode="token-mean", device="cpu"))
    p = demo_tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    r = demo_tokenizer(" Paris, a city", add_special_tokens=False)["input_ids"]
    before = trainer.compute_logprobs(p, r, 1.0)
    up = [i % 2 == 0 for i in range(len(r))]
    teacher = [lp + (1.0 if u else -1.0) for lp, u in zip(before, up)]
    s = Sample(p, r, list(before), 0.0, 1.0, "e", teacher_logprobs=teacher)
    distill_samples([s], kl_coef=1.0, reward_weight=0.0)
    trainer.train([s], PolicyGradient(0.2, 0.28))
    after = trainer.compute_logprobs(p, r, 1.0)
    moved = [a - b for a, b in zip(after, before)]
    assert all((m > 0) == u for m, u in zip(moved, up)), moved


# --- which tokens the teacher scores -----------------------------------------------------------------------------

def test_chains_score_a_conversation_once_and_each_call_reads_its_own_tokens():
    a1 = call([1, 2], [3, 4])
    a2 = call([1, 2, 3, 4, 9, 9], [5])  # extends a1: tool result 9 9 between
    b1 = call([1, 2], [6], agent="critic")  # another agent: its own chain
    skipped = call([1], [2], trainable=False)
    restart = call([8], [7])  # does not extend a2: a new chain
    calls = [a1, b1, a2, skipped, restart]
    assert teacher_chains(calls) == [[0, 2], [1], [4]]
    values = [-0.1 * i for i in range(1, 7)]  # the sequence 1 2 3 4 9 9 5: values[i] = log p(x_{i+1} | x_<=i)
    assert response_slice(values, a1) == pytest.approx([-0.2, -0.3])  # tokens at positions 2 and 3
    assert response_slice(values, a2) == pytest.approx([-0.6])
    with pytest.raises(ValueError, match="the call needs 7"):
        response_slice(values[:3], a2)


class FakeTeacher:
    """log p = -0.01 * token id; fails on any sequence holding `poison`."""

    name = "fake"

    def __init__(self, poison: int | None = None) -> None:
        self.poison, self.sent = poison, []

    def score(self, sequences, topk=0):
        self.sent += sequences
        return [RuntimeError("teacher server said 503") if self.poison in seq
                else PromptLogprobs([-0.01 * t for t in seq[1:]],
                                    [[(t + j, -0.01 * t - j) for j in range(topk)] for t in seq[1:]] if topk else None)
                for seq in sequences]


def episode(uid: str, task: str, calls: list[LLMCall], reward: float) -> Episode:
    return Episode(Task(task, "q"), 0, uid, calls=calls, reward=reward)


def test_a_failing_teacher_flags_its_episode_which_is_neither_trained_nor_a_zero():
    good = episode("g", "t", [call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6])], 1.0)
    bad = episode("b", "t", [call([1, 2], [3, 666])], 0.0)
    teacher = FakeTeacher(poison=666)
    metrics = score_episodes(teacher, [good, bad])
    assert teacher.sent == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 666]]  # the merged chain once
    assert good.calls[0].teacher_logprobs == pytest.approx([-0.03, -0.04])
    assert good.calls[1].teacher_logprobs == pytest.approx([-0.06])
    assert FLAG_FAILED in bad.flags and FLAG_TEACHER_FAILED in bad.flags and not bad.trainable
    assert bad.error_source == "teacher" and "503" in bad.error_summary
    assert metrics["distill/teacher_failed_episodes"] == 1.0 and metrics["distill/teacher_sequences"] == 2.0
    samples = episodes_to_samples([good, bad], adv_estimator="grpo", norm_by_std=True, epsilon=1e-6,
                                  max_sample_per_task=8, sample_mode="merge")
    assert {s.episode_uid for s in samples} == {"g"}  # the failed one: no sample, not a 0-reward group member
    assert samples[0].advantage == 0.0  # alone in its group: the bad episode's 0 did not enter the baseline
    distill_samples(samples, 1.0, 0.0)
    s = samples[0]  # merged: 3 4 | 5 | 6, the tool token masked
    assert s.loss_mask == [1, 1, 0, 1]
    assert s.token_advantages == pytest.approx([-0.03 + 1, -0.04 + 1, 0.0, -0.06 + 1])


def test_every_episode_failing_the_teacher_stops_the_run_with_the_teachers_advice():
    from astuner.errors import TrainingStalled
    from astuner.loop import ResumeState
    from astuner.selection import SelectionSettings, choose_selection

    policy = choose_selection(SelectionSettings(4, "grpo", True, 1e-6, 8, algorithm="on_policy_distillation"))

    class Stages:
        teacher = FakeTeacher(poison=3)

        def rollout(self, tasks, validation, step, progress=None):
            return [episode(f"e{i}", "t", [call([1, 2], [3])], float(i)) for i in range(2)]

    chosen = policy.gather(Stages(), [Task("t", "q")], iter(()), 1, 0, 1)
    with pytest.raises(TrainingStalled, match="the teacher .* could not score.*Check the teacher"):
        policy.learn(chosen, ResumeState(), 1)


# --- whole runs and start-up checks ------------------------------------------------------------------------------

WORKFLOW = '''
from astuner import Workflow, WorkflowOutput

class TwoTurns(Workflow):
    async def execute(self, workflow_task, model_tuner):
        messages = [{"role": "user", "content": workflow_task.task.main_query}]
        first = await model_tuner.chat(messages)
        messages += [first, {"role": "user", "content": "Once more."}]
        second = await model_tuner.chat(messages)
        return WorkflowOutput(reward=float(len(second["content"]) % 2), metadata={"final_answer": second["content"]})
'''


def write_run(folder: Path, student: Path, teacher: str, steps: int = 2, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wf.py").write_text(WORKFLOW)
    rows = [{"question": f"Say a word about {w}."} for w in ["cats", "rain", "maps", "tea"]]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = folder / "distil.yaml"
    yaml.write_text(f"""
astuner:
  project_name: distil
  experiment_dir: {folder / "out"}
  model: {{path: {student}}}
  teacher: {teacher}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file: {{training: {{file_path: train.jsonl}}}}
  data: {{train_batch_size: 2, max_response_length: 64}}
  rollout: {{engine: hf, agentscope_workflow: wf.py->TwoTurns, num_repeat: 2, max_env_worker: 4,
            max_response_length_in_one_turn: 8, max_model_len: 256, compute_madness_checklist: [],
            multi_turn: {{sample_mode: merge}}}}
  trainer_common: {{total_training_steps: {steps}, test_freq: 99999, save_freq: 99999, val_before_train: false,
                   optim: {{lr: 1.0e-3}}, algorithm: {{type: on_policy_distillation{extra}}}}}
""")
    return yaml


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model's architecture with other random weights: a teacher that disagrees with the student."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(tiny_model_dir).config)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_run_with_a_model_folder_teacher_trains_on_its_signal(tmp_path, tiny_model_dir, teacher_dir):
    yaml = write_run(tmp_path, tiny_model_dir, f"{{model: {teacher_dir}}}")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    got = rows(tmp_path / "out")
    assert len(got) == 2
    for r in got:
        assert r["distill/teacher_sequences"] == 4.0  # 2 tasks x 2 repeats, each episode's two calls as one chain
        assert r["distill/teacher_failed_episodes"] == 0.0
        # At ratio 1 the loss is -mean_t A_t = mean_t (s_t - q_t): exactly the reverse KL estimate it lowers.
        assert r["actor/policy_loss"] == pytest.approx(r["distill/reverse_kl"], rel=1e-3)
        assert r["distill/reverse_kl"] != 0.0
    # The log viewer holds the teacher's logprob of every token, and the step's reverse KL is their mean gap.
    from astuner.logview import store

    conn = store.connect(tmp_path / "out" / store.FILE_NAME, readonly=True)
    gaps = []
    for item in store.episodes(conn, "train", 1)["items"]:
        for c in store.episode(conn, item["id"])["calls"]:
            t = c["tokens"]
            assert len(t["teacher_logprob"]) == len(t["ids"])
            gaps += [s - q for s, q in zip(t["logprob"], t["teacher_logprob"])]
    assert got[0]["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)


@pytest.mark.slow
def test_a_teacher_with_another_vocabulary_stops_the_run_at_start(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json",):
        (other / name).write_text((tiny_model_dir / name).read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<|only_the_teacher|>"])
    tok.save_pretrained(other)
    yaml = write_run(tmp_path / "run", tiny_model_dir, f"{{model: {other}}}")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    err = capsys.readouterr().err
    assert "another vocabulary than the student" in err and str(tiny_model_dir) in err and str(other) in err
    assert "<|only_the_teacher|>" in err
    assert not (tmp_path / "run" / "out" / "metrics.jsonl").exists()


def test_one_tokenizer_check_serves_the_roster_and_the_teacher(demo_tokenizer):
    """A teacher scores token ids: another chat template is no matter; a model of the roster is prompted through the
    run's renderer: it is. Another end-of-sequence token matters to both."""
    import copy

    from astuner.errors import UserError
    from astuner.tokenizer import check_same_tokenizer

    ours, other = demo_tokenizer, copy.deepcopy(demo_tokenizer)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    check_same_tokenizer(ours, "teacher", "astuner.teacher.model", other=other, template=False)
    with pytest.raises(UserError, match=r"critic has another chat template than the policy \(astuner.model.path\)"):
        check_same_tokenizer(ours, "critic", "astuner.models.critic.path", other=other)
    other.eos_token = "<|im_start|>"
    with pytest.raises(UserError, match="teacher has another end-of-sequence token than the student s: "
                                        r"'<\|im_start\|>' against '<\|im_end\|>'"):
        check_same_tokenizer(ours, "teacher", "astuner.teacher.model", other=other, template=False,
                             whose="the student s")


def test_no_teacher_or_two_is_a_config_error(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir, "{}")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    assert "needs one teacher" in capsys.readouterr().err
    yaml = write_run(tmp_path, tiny_model_dir, "{model: a, base_url: 'http://x/v1'}")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    assert "not both" in capsys.readouterr().err
    yaml = write_run(tmp_path, tiny_model_dir, "{model: a}", extra=", distill_teacher_temperature: 0.5")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    assert "distill_teacher_temperature 0.5 needs the teacher's top k" in capsys.readouterr().err


def teacher_server(model_dir: Path, tokenizer, fail: bool = False, other_vocab: bool = False):
    """An OpenAI-compatible completions server over the HF engine: prompt logprobs by echo, as vLLM returns them
    (tokens as "token_id:N" when asked)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from astuner.engine.hf_engine import HFEngine

    engine = HFEngine(str(model_dir), device="cpu")
    seen = {"auth": set(), "prompts": 0}

    async def models(request):
        return JSONResponse({"data": [{"id": "the-teacher"}]})

    async def completions(request):
        body = await request.json()
        seen["auth"].add(request.headers.get("authorization"))
        if fail:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        prompts = body["prompt"]
        prompts = [prompts] if isinstance(prompts, str) or isinstance(prompts[0], int) else prompts
        choices = []
        for k, p in enumerate(prompts):
            ids = tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p
            if other_vocab and isinstance(p, str):
                ids = [i + 1 for i in ids]
            seen["prompts"] += 1
            topk = body.get("logprobs") or 0
            scored = engine.prompt_logprobs(list(ids), topk=topk)
            entry = {"tokens": [f"token_id:{i}" for i in ids] + ["token_id:0"],
                     "token_logprobs": [None] + scored.values + [-1.0]}
            if topk:  # as vLLM: the prompt's own token beside the top k (k + 1 entries where it is not among them)
                entry["top_logprobs"] = [None] + [
                    {**{f"token_id:{t}": lp for t, lp in top}, f"token_id:{tok}": v}
                    for top, tok, v in zip(scored.topk, ids[1:], scored.values)] + [{"token_id:0": -1.0}]
            choices.append({"index": k, "text": "x", "logprobs": entry})
        return JSONResponse({"choices": choices})

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
    url, stop = serve_in_thread(app)
    return url + "/v1", stop, seen


def same_topk(remote, local, k):
    for a, b in zip(remote, local):
        assert a.values == pytest.approx(b.values, abs=1e-5)
        assert [[t for t, _ in p] for p in a.topk] == [[t for t, _ in p] for p in b.topk]
        assert [lp for p in a.topk for _, lp in p] == pytest.approx([lp for p in b.topk for _, lp in p], abs=1e-5)
        assert all(len(p) == k for p in a.topk)


@pytest.mark.slow
def test_a_server_teacher_scores_as_the_same_model_in_process(tmp_path, tiny_model_dir, teacher_dir,
                                                              demo_tokenizer, monkeypatch):
    from astuner.distill.teachers import EndpointTeacher, EngineTeacher
    from astuner.engine.hf_engine import HFEngine

    url, stop, seen = teacher_server(teacher_dir, demo_tokenizer)
    try:
        monkeypatch.setenv("MY_TEACHER_KEY", "sk-test")
        remote = EndpointTeacher(url, None, "MY_TEACHER_KEY", 30, batch_size=2)
        assert remote.model == "the-teacher"
        local = EngineTeacher(HFEngine(str(teacher_dir), device="cpu"), 30, "local")
        seqs = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
        for a, b in zip(remote.score(seqs), local.score(seqs)):
            assert a.values == pytest.approx(b.values, abs=1e-5) and a.topk is None
        assert seen["auth"] == {"Bearer sk-test"} and seen["prompts"] == 3
        same_topk(remote.score(seqs, topk=3), local.score(seqs, topk=3), 3)  # the server sends k + 1: k are kept
        # A whole run against it, with the top-k term.
        yaml = write_run(tmp_path, tiny_model_dir, f"{{base_url: '{url}', api_key_env: MY_TEACHER_KEY}}", steps=1,
                         extra=", distill_topk: 3")
        assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
        got = rows(tmp_path / "out")[0]
        assert got["distill/teacher_sequences"] == 4.0 and got["actor/distill_topk_kl"] > 0
    finally:
        stop()


def test_a_server_teacher_that_fails_or_reads_other_tokens(tmp_path, tiny_model_dir, teacher_dir, demo_tokenizer,
                                                          capsys):
    from astuner.distill.teachers import EndpointTeacher

    url, stop, _ = teacher_server(teacher_dir, demo_tokenizer, other_vocab=True)
    try:
        yaml = write_run(tmp_path / "a", tiny_model_dir, f"{{base_url: '{url}'}}", steps=1)
        assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
        err = capsys.readouterr().err
        assert "does not read the student's tokens" in err and "the-teacher" in err and str(tiny_model_dir) in err
    finally:
        stop()
    url, stop, _ = teacher_server(teacher_dir, demo_tokenizer, fail=True)
    try:
        results = EndpointTeacher(url, "the-teacher", "NO_SUCH_KEY", 30, 2).score([[1, 2, 3], [4, 5]])
        assert all(isinstance(r, RuntimeError) and "503" in str(r) for r in results)
    finally:
        stop()


@pytest.mark.slow
def test_a_tinker_server_teacher_is_astuner_serve_scoring_as_the_model_in_process(tmp_path, tiny_model_dir,
                                                                                  teacher_dir):
    """The Tinker API (`astuner serve`, through the tinker SDK): a sampler of the teacher's base model."""
    from astuner.config import load_config
    from astuner.distill.teachers import EngineTeacher, TinkerTeacher
    from astuner.engine.hf_engine import HFEngine
    from astuner.serve import build_service, tinker_server
    from astuner.serve.keys import KeyStore
    from astuner.serve.limits import ServeLimits

    from test_serve_tinker import write_yaml  # the served model's YAML (it also turns the SDK's telemetry off)

    serve_yaml = write_yaml(tmp_path / "served", teacher_dir)
    server = tinker_server(build_service(load_config(str(serve_yaml), []), ServeLimits()),
                           KeyStore(tmp_path / "keys.json"), poll_wait_s=2.0)
    url, remote = server.start(), None
    try:
        remote = TinkerTeacher(url, str(teacher_dir), "NO_SUCH_KEY", 60)
        local = EngineTeacher(HFEngine(str(teacher_dir), device="cpu"), 30, "local")
        seqs = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
        for a, b in zip(remote.score(seqs), local.score(seqs)):
            assert a.values == pytest.approx(b.values, abs=1e-5)
        same_topk(remote.score(seqs, topk=2), local.score(seqs, topk=2), 2)
        yaml = write_run(tmp_path / "run", tiny_model_dir,
                         f"{{base_url: '{url}', api: tinker, served_model: '{teacher_dir}'}}", steps=1)
        assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
        assert rows(tmp_path / "run" / "out")[0]["distill/teacher_failed_episodes"] == 0.0
    finally:
        if remote is not None:
            remote.shutdown()  # ends its SDK session before the server goes
        server.stop()


@pytest.mark.slow
def test_the_start_up_plan_counts_a_model_folder_teacher(tmp_path, tiny_model_dir, teacher_dir):
    """A teacher loaded in the debug backbone's one process holds memory beside the student's engine and trainer:
    the plan counts it (the HF engine's fp32 weights; vLLM on CPU its runtime and KV cache too) and names it."""
    from astuner import preflight
    from astuner.config import load_config
    from astuner.runtime import prepare

    yaml = write_run(tmp_path, tiny_model_dir, f"{{model: {teacher_dir}}}")
    params = preflight.read_model_facts(str(teacher_dir)).num_params
    plan = prepare(load_config(str(yaml), [])).plan
    assert plan.teacher[0] == 4 * params and "on hf: " in plan.teacher[1]
    assert f", teacher {4 * params / 2**30:.1f}" in plan.block(preflight.read_model_facts(str(tiny_model_dir)))
    vllm = prepare(load_config(str(yaml), ["astuner.teacher.engine=vllm"])).plan
    assert vllm.teacher[0] > 4 * params + preflight.VLLM_CPU_RUNTIME and "KV cache" in vllm.teacher[1]
    assert vllm.total_bytes - plan.total_bytes == vllm.teacher[0] - plan.teacher[0]


def test_on_cuda_a_vllm_teacher_and_the_runs_engines_split_the_gpu_share(tmp_path, tiny_model_dir, teacher_dir,
                                                                         monkeypatch):
    """Each vLLM engine reads gpu_memory_utilization as its own: the student's at 0.6 and a teacher's at 0.6 beside
    it would ask for 1.2 cards, and the teacher could not start. Both take their part (checked with the engines'
    builders faked: the shares are what matter)."""
    from astuner import runtime
    from astuner.config import load_config
    from astuner.config.derived import run_facts
    from astuner.distill import build_teacher
    from astuner.engine import build
    from astuner.run_models import build_models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = []
    monkeypatch.setattr(build, "build_engine", lambda typed, path, *a, gpu_share=None, **k: built.append(
        (path, gpu_share)) or object())
    typed = load_config(str(write_run(tmp_path, tiny_model_dir, f"{{model: {teacher_dir}}}")),
                        ["astuner.rollout.engine=vllm"]).typed
    build_models(typed, run_facts(typed), None, runtime.model_set(typed), 256, 1, roles=("engine",), extra_engines=1)
    teacher = build_teacher(typed, None, build.build_engine, vllm_engines_here=1)
    assert [share for _, share in built] == [pytest.approx(0.3), pytest.approx(0.3)]
    assert built[1][0] == str(teacher_dir) and teacher.engine is not None
