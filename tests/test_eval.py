"""`astuner eval`: pass@k and the paired interval by hand, and the command end to end on the tiny model."""

from __future__ import annotations

import csv
import json
import math

import pytest

from astuner.algorithm.pass_at_k import ks_for, paired_difference, pass_at_k, summarize, task_results
from astuner.types import Episode, LLMCall, Task


def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 success: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; pass@4 = 1.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    # n = 5, c = 2: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; pass@3 = 1 - C(3,3)/C(5,3) = 0.9.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(4, 1, 5)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


def test_paired_difference_and_its_interval():
    x = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    y = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # better on 3 tasks, never worse: mean +3/8
    mean, low, high = paired_difference(x, y)
    assert mean == pytest.approx(0.375)
    assert 0.0 <= low < 0.375 < high <= 0.75  # every resampled mean lies in [0, 6/8]
    assert paired_difference(x, x) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(x, y[:3])


def _episode(task_id, i, success, tokens=3, tag="val"):
    call = LLMCall(prompt_ids=[1], response_ids=[2] * tokens, response_logprobs=[-0.1] * tokens,
                   finish_reason="stop", temperature=1.0)
    return Episode(Task(task_id, "q"), i, f"{tag}:{task_id}#{i}", calls=[call], reward=float(success),
                   is_success=success)


def test_task_results_and_summary_by_hand():
    greedy = [_episode("a", 0, True), _episode("b", 0, False)]
    sampled = [_episode("a", i, s) for i, s in enumerate([True, False, True, True])]
    sampled += [_episode("b", i, s, tokens=5) for i, s in enumerate([False, False, False, True])]
    results = task_results(greedy, sampled, [1, 2, 4])
    assert [(r.task_id, r.samples, r.successes) for r in results] == [("a", 4, 3), ("b", 4, 1)]
    # a: pass@2 = 1 - C(1,2)/C(4,2) = 1; b: 0.5 (above).
    assert results[0].pass_at == pytest.approx({1: 0.75, 2: 1.0, 4: 1.0})
    assert results[1].pass_at == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    summary = summarize(results, greedy + sampled, [1, 2, 4])
    assert summary["greedy/success_rate"] == 0.5
    assert summary["sampled/pass@1"] == pytest.approx(0.5) and summary["sampled/pass@2"] == pytest.approx(0.75)
    assert summary["tokens_per_episode"] == pytest.approx((3 * 2 + 3 * 4 + 5 * 4) / 10)
    assert summary["failure_rate"] == 0.0


@pytest.mark.slow
def test_eval_command_compares_two_models(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from tests.test_run_contract import write_run
    from astuner.cli import main

    yaml = write_run(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval_out"
    code = main(["eval", "--conf", str(yaml), "--model", str(tiny_model_dir), "--model", str(tiny_model_dir),
                 "--num-repeat", "2", "--out", str(out), "astuner.rollout.max_response_length_in_one_turn=4"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "sampled/pass@2" in printed and "[95% CI]" in printed
    summary = json.loads((out / "eval_summary.json").read_text())
    first, second = summary["models"]
    assert first["label"] != second["label"]
    # The same weights, greedy: identical per-task outcomes, so the paired difference is exactly 0.
    (difference,) = summary["differences"]
    assert (difference["model"], difference["baseline"]) == (second["label"], first["label"])
    assert difference["greedy/success_rate"] == [0.0, 0.0, 0.0]
    rows = list(csv.DictReader(open(out / "eval_tasks.csv")))
    n_tasks = int(first["tasks"])
    assert len(rows) == 2 * n_tasks and all(r["samples"] == "2" for r in rows)
    assert set(rows[0]) >= {"greedy_success", "pass@1", "pass@2", "tokens_per_episode"}
    assert "tool_calls_per_episode" in first and "episodes_with_a_tool_call" in first
    # Every episode, per model, where the log viewer opens them (`astuner logview <out>`).
    from starlette.testclient import TestClient

    from astuner.logview.app import build_app

    client = TestClient(build_app(out))
    runs = sorted(r["id"] for r in client.get("/api/runs").json()["runs"])
    assert len(runs) == 2 and all(r.startswith("episodes/") for r in runs), runs
    steps = client.get(f"/api/runs/{runs[0]}/steps").json()["steps"]
    counts = {s["split"]: s["episodes"] for s in steps}
    assert counts == {"greedy": n_tasks, "sampled": 2 * n_tasks}, steps


def test_eval_command_bad_input(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from tests.test_run_contract import write_run
    from astuner.cli import main

    yaml = write_run(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--conf", str(yaml), "--model", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert main(["eval", "--conf", str(yaml), "--split", "test"]) == 2
    assert "val, train" in capsys.readouterr().err


def test_choose_pairs_default_named_and_every_pair():
    from astuner.errors import UserError
    from astuner.evaluation.runner import choose_pairs

    models = [None, "runs/warm/global_step_8", "runs/grpo/global_step_20"]
    warm, grpo = "warm/global_step_8", "grpo/global_step_20"
    assert choose_pairs(models) == [("base", warm), ("base", grpo)]  # against the first, as before
    assert choose_pairs(models, warm) == [(warm, "base"), (warm, grpo)]
    assert choose_pairs(models, "runs/grpo/global_step_20") == [(grpo, "base"), (grpo, warm)]  # the --model value
    assert choose_pairs(models, "all") == [("base", warm), ("base", grpo), (warm, grpo)]
    assert choose_pairs(["m", "m"], "m'") == [("m'", "m")]  # a repeated model's label carries a prime
    with pytest.raises(UserError, match=f"the models are base, {warm}, {grpo}"):
        choose_pairs(models, "sft")


def _report(label, successes):
    from astuner.algorithm.pass_at_k import TaskResult
    from astuner.evaluation.runner import ModelReport

    tasks = [TaskResult(f"t{i}", float(s), bool(s)) for i, s in enumerate(successes)]
    return ModelReport(label, label, tasks, {"greedy/success_rate": sum(successes) / len(successes)})


def test_differences_against_a_named_baseline_by_hand():
    from astuner.evaluation.runner import choose_pairs, comparisons, table

    reports = [_report("base", [0, 0, 0, 1]), _report("warm", [1, 0, 0, 1]), _report("grpo", [1, 1, 1, 1])]
    pairs = choose_pairs(["base", "warm", "grpo"], "warm")
    diffs = comparisons(reports, pairs)
    assert [d.name for d in diffs] == ["base - warm", "grpo - warm"]
    # base - warm: per task (-1, 0, 0, 0), mean -1/4; grpo - warm: (0, 1, 1, 0), mean +1/2.
    (m1, low1, high1), (m2, low2, high2) = (d.metrics["greedy/success_rate"] for d in diffs)
    assert m1 == pytest.approx(-0.25) and -1.0 <= low1 <= m1 <= high1 <= 0.0
    assert m2 == pytest.approx(0.5) and 0.0 <= low2 <= m2 <= high2 <= 1.0
    every = comparisons(reports, choose_pairs(["base", "warm", "grpo"], "all"))
    assert [(d.name, d.metrics["greedy/success_rate"][0]) for d in every] == [
        ("warm - base", 0.25), ("grpo - base", 0.75), ("grpo - warm", 0.5)]
    header = table(reports, pairs).splitlines()[0]
    assert "base - warm [95% CI]" in header and "grpo - warm [95% CI]" in header and "warm - base" not in header


def test_eval_unknown_baseline_exits_2_naming_the_models_before_any_model_runs(tmp_path, tiny_model_dir, capsys,
                                                                             monkeypatch):
    from tests.test_run_contract import write_run
    from astuner.cli import main

    yaml = write_run(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval_out"
    code = main(["eval", "--conf", str(yaml), "--model", "base", "--model", str(tiny_model_dir),
                 "--baseline", "sft", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--baseline sft: no such model; the models are base, {tiny_model_dir.name}" in err
    assert not out.exists()  # refused before the log file or any model
    assert main(["eval", "--conf", str(yaml), "--baseline", "base", "--all-pairs"]) == 2
    assert "give one of the two" in capsys.readouterr().err


def test_a_void_model_shows_n_a_for_its_scores_and_its_differences():
    from dataclasses import replace

    from astuner.evaluation.runner import table

    base, void = _report("base", [0, 1, 0, 1]), _report("warm", [0, 0, 0, 0])
    void = replace(void, summary={**void.summary, "failure_rate": 1.0}, void="4 of 4 timed out")
    rows = {line.split()[0]: line.split()[1:] for line in table([base, void]).splitlines()[1:]}
    assert rows["greedy/success_rate"] == ["0.500", "n/a", "n/a"]  # base, warm, warm - base
    assert rows["failure_rate"] == ["1.000"]  # the rates that say why stand


def test_tool_use_in_the_eval_summary_by_hand():
    from astuner.algorithm.pass_at_k import summarize, task_results
    from astuner.types import Episode, LLMCall, Task

    def episode(i, calls):
        reply = {"tool_calls": [{"name": "stock"}] * calls} if calls else {"content": "\\boxed{3}"}
        return Episode(Task(f"t{i}", "q"), 0, f"e{i}", calls=[LLMCall([1], [2], [-1.0], "stop", 1.0, reply=reply)])

    greedy = [episode(0, 2), episode(1, 0), episode(2, 1), episode(3, 0)]
    summary = summarize(task_results(greedy, [], []), greedy, [])
    assert summary["tool_calls_per_episode"] == 3 / 4 and summary["episodes_with_a_tool_call"] == 2 / 4
