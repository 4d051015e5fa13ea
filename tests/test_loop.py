"""The loop's own logic with fake stages: batching, schedule of validation and checkpoints, metrics, summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from astuner.errors import TrainingStalled, WorkerLost
from astuner.loop import LoopSettings, ResumeState, count_steps, run_loop, task_batches
from astuner.selection import SelectionSettings
from astuner.monitor import episode_metrics, zero_adv_group_fraction
from astuner.stages import Stages
from astuner.types import Episode, LLMCall, SyncReport, Task, TrainResult


def settings(**kw):
    """LoopSettings; keys of SelectionSettings go to its `selection`."""
    base = dict(train_batch_size=2, total_epochs=2, total_training_steps=None, save_freq=2, test_freq=3,
                val_before_train=True, shuffle=True, seed=0)
    chosen = dict(adv_estimator="grpo", norm_adv_by_std=True, adv_epsilon=1e-6, max_sample_per_task=4)
    for key, value in kw.items():
        shared = key == "train_batch_size"  # both read it
        (chosen if key in SelectionSettings.__dataclass_fields__ and not shared else base)[key] = value
    return LoopSettings(**base, selection=SelectionSettings(train_batch_size=base["train_batch_size"], **chosen))


TASKS = [Task(f"t{i}", f"q{i}") for i in range(5)]


def test_batches_cover_every_task_once_per_epoch_with_a_short_last_batch():
    batches = [b for b, _, _ in task_batches(TASKS, settings())]
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(t.task_id for b in epoch for t in b) == [t.task_id for t in TASKS]
    assert [t.task_id for t in batches[0] + batches[1]] != [t.task_id for t in batches[3] + batches[4]]  # reshuffled
    assert next(task_batches(TASKS, settings(shuffle=False)))[0] == TASKS[:2]


def test_batches_resume_from_a_cursor_in_the_same_order():
    full = list(task_batches(TASKS, settings()))
    # After the 4th batch: epoch 1, position 2 (its 2 tasks taken).
    assert full[3][1:] == (1, 2)
    resumed = list(task_batches(TASKS, settings(), epoch=1, position=2))
    assert [b for b, _, _ in resumed] == [b for b, _, _ in full[4:]]


def test_step_count_and_cap():
    assert count_steps(5, settings()) == 6
    assert count_steps(5, settings(total_training_steps=4)) == 4


def call(n):
    return LLMCall([1, 2], [3] * n, [-1.0] * n, "stop", 1.0)


def test_episode_metrics_by_hand():
    task = Task("t", "q")
    episodes = [
        Episode(task, 0, "a", calls=[call(2), call(4)], reward=1.0, is_success=True),
        Episode(task, 1, "b", calls=[call(3)], reward=0.0, flags=["nonsense"]),
        Episode(task, 2, "c", calls=[], flags=["failed"]),
        Episode(task, 3, "d", calls=[call(1)], reward=0.5, flags=["overflow"]),
    ]
    m = episode_metrics(episodes, "train")
    assert m["train/reward_mean"] == 0.5  # failed episodes have no reward to average
    assert abs(m["train/reward_std"] - (1 / 6) ** 0.5) < 1e-12
    assert m["train/success_rate"] == 0.25
    assert m["train/response_length"] == 10 / 4 and m["train/turns_per_episode"] == 1.0
    assert m["train/madness_rate"] == m["train/failure_rate"] == m["train/overflow_rate"] == 0.25
    assert m["train/tool_calls_per_episode"] == 0.0 and m["train/tool_call_parse_failure_rate"] == 0.0


def test_tool_metrics_by_hand():
    """3 episodes: two parsed calls in one response, one malformed attempt, one plain answer."""
    task = Task("t", "q")
    two = LLMCall([1], [2], [-1.0], "stop", 1.0, tool_call_attempted=True,
                  reply={"tool_calls": [{"name": "a"}, {"name": "b"}]})
    bad = LLMCall([1], [2], [-1.0], "stop", 1.0, tool_call_attempted=True, tool_call_parse_failed=True,
                  reply={"content": "<tool_call>{"})
    plain = LLMCall([1], [2], [-1.0], "stop", 1.0, reply={"content": "done"})
    episodes = [Episode(task, 0, "a", calls=[two, plain]), Episode(task, 1, "b", calls=[bad, plain]),
                Episode(task, 2, "c", calls=[plain])]
    m = episode_metrics(episodes, "val")
    assert m["val/tool_calls_per_episode"] == 2 / 3  # parsed calls handed to the agent, per episode
    assert m["val/tool_call_parse_failure_rate"] == 1 / 2  # of the 2 responses that tried a call


class FakeStages(Stages):

    def __init__(self, rewards=lambda step, i: float(i), flags=lambda step: []):
        self.events = []
        self.rewards, self.flags = rewards, flags

    def rollout(self, tasks, validation, step=0, progress=None):
        self.events.append(("val" if validation else "rollout", len(tasks)))
        return [Episode(t, i, f"{t.task_id}#{i}", calls=[call(2)], reward=self.rewards(step, i), is_success=i > 0,
                        flags=list(self.flags(step)), error="Traceback ...\nValueError: boom" if self.flags(step) else None)
                for t in tasks for i in range(1 if validation else 2)]

    def train(self, samples, objective="policy"):
        self.events.append(("train", len(samples)))
        return TrainResult({"policy_loss": 0.0}, [None] * len(samples))

    def sync_weights(self):
        self.events.append(("sync",))

    def save_checkpoint(self, step, run_state):
        self.events.append(("save", step))
        self.run_state = run_state
        return Path(f"global_step_{step}")


class FakeMonitor:
    def __init__(self):
        self.logged, self.saved, self.done = [], [], []

    def log_metrics(self, step, metrics):
        self.logged.append((step, metrics))

    def save_episodes(self, step, episodes, tag, samples=None):
        self.saved.append((step, tag))

    def step_done(self, step, metrics):
        self.done.append(step)


def test_schedule_of_validation_training_and_checkpoints():
    stages, monitor = FakeStages(), FakeMonitor()
    summary = run_loop(settings(total_training_steps=4), stages, TASKS, TASKS[:3], monitor)
    kinds = [e for e in stages.events if e[0] in ("val", "save")]
    assert kinds == [("val", 3), ("save", 2), ("val", 3), ("val", 3), ("save", 4)]  # val at 0, 3, 4; save at 2, 4
    assert stages.events[1:4] == [("rollout", 2), ("train", 4), ("sync",)]  # 2 tasks x 2 episodes -> 4 samples
    assert summary.steps == 4 and sorted(summary.val_scores) == [0, 3, 4]
    assert summary.last_checkpoint == Path("global_step_4") and monitor.done == [1, 2, 3, 4]
    assert "4 steps" in summary.line("run") and "validation accuracy 0.000 (step 0)" in summary.line("run")


def test_a_step_whose_episodes_all_failed_stops_the_run_with_the_first_error():
    stages = FakeStages(flags=lambda step: ["failed"] if step == 2 else [])
    with pytest.raises(TrainingStalled, match="step 2: all 4 episodes failed.*ValueError: boom"):
        run_loop(settings(total_training_steps=4), stages, TASKS, [], FakeMonitor())
    assert ("train", 4) in stages.events  # step 1 trained


def test_a_failed_judge_is_named_in_the_advice():
    class JudgeFails(FakeStages):
        def rollout(self, tasks, validation=False, step=0, **kw):
            episodes = super().rollout(tasks, validation=validation, step=step, **kw)
            for e in episodes:
                e.flags, e.error_source = ["failed"], "judge"
                e.error = e.error_summary = "judge Scorer raised KeyError: 'answer'"
            return episodes

    with pytest.raises(TrainingStalled, match="First error: episode .*: judge Scorer raised KeyError: 'answer'. "
                                              "Fix the judge"):
        run_loop(settings(total_training_steps=2), JudgeFails(), TASKS, [], FakeMonitor())


def test_steps_without_learning_signal_stop_after_max_idle_steps():
    # Step 1 has a reward spread; from step 2 on every group's rewards are equal: advantages are all 0.
    stages, monitor = FakeStages(rewards=lambda step, i: float(i) if step == 1 else 1.0), FakeMonitor()
    with pytest.raises(TrainingStalled, match="3 steps in a row.*zero_adv_group_fraction.*astuner warmstart --seed 1"):
        run_loop(settings(total_training_steps=6, max_idle_steps=3), stages, TASKS, [], monitor)
    fractions = [m["train/zero_adv_group_fraction"] for _, m in monitor.logged]
    assert fractions == [0.0, 1.0, 1.0, 1.0]
    # The KL loss gives zero-advantage samples a gradient: not idle.
    run_loop(settings(total_training_steps=4, max_idle_steps=2, grad_without_advantage=True),
             FakeStages(rewards=lambda step, i: 1.0), TASKS, [], FakeMonitor())


def test_zero_adv_group_fraction_by_hand():
    a, b = Task("a", "q"), Task("b", "q")
    eps = [Episode(a, 0, "a0", calls=[call(1)], reward=1.0), Episode(a, 1, "a1", calls=[call(1)], reward=1.0),
           Episode(b, 0, "b0", calls=[call(1)], reward=0.0), Episode(b, 1, "b1", calls=[call(1)], reward=1.0),
           Episode(b, 2, "b2", calls=[], flags=["failed"])]
    assert zero_adv_group_fraction(eps) == 0.5


def test_run_state_is_the_resume_cursor():
    stages = FakeStages()
    run_loop(settings(total_training_steps=4), stages, TASKS, [], FakeMonitor())
    assert stages.run_state["step"] == 4 and (stages.run_state["epoch"], stages.run_state["position"]) == (1, 2)
    resumed = FakeStages()
    state = ResumeState(step=2, epoch=0, position=4)
    summary = run_loop(settings(total_training_steps=4), resumed, TASKS, TASKS[:1], FakeMonitor(), resume=state)
    assert [e for e in resumed.events if e[0] == "rollout"] == [("rollout", 1), ("rollout", 2)]
    assert ("val", 1) not in resumed.events[:1]  # no validation "before training" on a resumed run
    assert summary.steps == 4


def test_informative_groups_by_hand():
    from astuner.algorithm.dynamic_sampling import informative_groups, keep_groups

    a, b, c, d = (Task(x, "q") for x in "abcd")
    eps = [Episode(a, 0, "a0", calls=[call(1)], reward=1.0), Episode(a, 1, "a1", calls=[call(1)], reward=1.0),
           Episode(b, 0, "b0", calls=[call(1)], reward=0.0, is_success=False),
           Episode(b, 1, "b1", calls=[call(1)], reward=0.5, is_success=False),
           Episode(c, 0, "c0", calls=[call(1)], reward=1.0, is_success=True),
           Episode(c, 1, "c1", calls=[], flags=["failed"]),  # one trainable episode left: no signal
           Episode(d, 0, "d0", calls=[call(1)], reward=0.0), Episode(d, 1, "d1", calls=[call(1)], reward=1.0,
                                                                     is_success=True)]
    assert informative_groups(eps, "score") == ["b", "d"]
    assert informative_groups(eps, "acc") == ["d"]  # b's rewards differ but neither succeeded
    assert [e.episode_uid for e in keep_groups(eps, ["d", "b"])] == ["b0", "b1", "d0", "d1"]


def test_dynamic_sampling_rolls_out_more_tasks_until_the_batch_is_full():
    # Tasks t0, t2, t4 give equal rewards (no signal); t1, t3 differ. Batch 2, no shuffle.
    stages = FakeStages(rewards=lambda step, i: 0.0)
    informative = {"t1", "t3"}
    base_rollout = stages.rollout

    def rollout(tasks, validation, step=0, progress=None):
        eps = base_rollout(tasks, validation, step)
        for e in eps:
            e.reward = float(e.repeat_index) if e.task.task_id in informative else 1.0
        return eps

    stages.rollout = rollout
    monitor = FakeMonitor()
    s = settings(total_epochs=1, shuffle=False, val_before_train=False, filter_groups=True, max_num_gen_batches=0)
    summary = run_loop(s, stages, TASKS, [], monitor)
    # Step 1: [t0, t1] -> 1 kept; [t2, t3] -> 2 kept: trains on t1 and t3 (4 samples). Step 2: [t4] -> 0 kept,
    # and the data is out: an idle step, trained on nothing.
    assert [e for e in stages.events if e[0] in ("rollout", "train")] == [
        ("rollout", 2), ("rollout", 2), ("train", 4), ("rollout", 1)]
    assert summary.steps == 2
    first = monitor.logged[0][1]
    assert (first["train/dynamic_sampling/gen_batches"], first["train/dynamic_sampling/kept_groups"],
            first["train/dynamic_sampling/dropped_groups"]) == (2.0, 2.0, 2.0)
    assert first["train/zero_adv_group_fraction"] == 0.5  # over everything rolled out
    assert stages.run_state["position"] == 5
    # A cap of 1 batch: step 1 trains on t1 alone, step 2 on t3 alone.
    capped = FakeStages()
    capped.rollout = lambda tasks, validation, step=0, progress=None: [
        Episode(t, i, f"{t.task_id}#{i}", calls=[call(2)], reward=float(i) if t.task_id in informative else 1.0)
        for t in tasks for i in range(2)]
    run_loop(settings(total_epochs=1, shuffle=False, val_before_train=False, filter_groups=True,
                      max_num_gen_batches=1, max_idle_steps=5), capped, TASKS, [], FakeMonitor())
    assert [e for e in capped.events if e[0] == "train"] == [("train", 2), ("train", 2)]


def test_the_loop_hands_its_progress_bars_to_every_rollout():
    seen = []

    class Recording(FakeStages):
        def rollout(self, tasks, validation, step=0, progress=None):
            seen.append(("val" if validation else "train", progress))
            return super().rollout(tasks, validation, step, progress)

    def bars(description, total):
        raise AssertionError("a fake stage draws no bar")

    run_loop(settings(total_training_steps=2), Recording(), TASKS, TASKS[:2], FakeMonitor(), progress=bars)
    assert {kind for kind, _ in seen} == {"val", "train"} and all(p is bars for _, p in seen)


def test_validation_reports_pass_at_k_with_val_num_repeat():
    class Sampled(FakeStages):
        def rollout_sampled(self, tasks, step, sampled_repeats, progress=None):
            self.events.append(("val-sampled", len(tasks) * sampled_repeats))
            # Task t0 succeeds on 1 of 4 samples, t1 on none.
            return [Episode(t, i, f"s:{t.task_id}#{i}", calls=[call(2)], reward=0.0,
                            is_success=t.task_id == "t0" and i == 0) for t in tasks for i in range(sampled_repeats)]

    stages, monitor = Sampled(), FakeMonitor()
    run_loop(settings(total_training_steps=1, val_num_repeat=4), stages, TASKS, TASKS[:2], monitor)
    assert ("val-sampled", 8) in stages.events
    val = next(m for _, m in monitor.logged if "val/accuracy" in m)
    # t0: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; t1: 0. Means over the 2 tasks.
    assert (val["val/pass@1"], val["val/pass@2"], val["val/pass@4"]) == pytest.approx((0.125, 0.25, 0.5))
    greedy_only = FakeMonitor()
    run_loop(settings(total_training_steps=1), FakeStages(), TASKS, TASKS[:2], greedy_only)
    assert "val/pass@1" not in next(m for _, m in greedy_only.logged if "val/accuracy" in m)


def test_rft_trains_sft_on_episodes_that_pass_the_threshold():
    class Recording(FakeStages):
        def train(self, samples, objective="policy"):
            self.events.append(("train", len(samples), objective, sorted({s.advantage for s in samples})))
            return TrainResult({}, [None] * len(samples))

    stages, monitor = Recording(), FakeMonitor()  # rewards 0 and 1 per task (repeat index)
    run_loop(settings(total_training_steps=2, algorithm="rft", rft_threshold=1.0), stages, TASKS, [], monitor)
    # 2 tasks x 2 episodes per step; the reward-1 episode of each task is kept: 2 samples, advantage 1, SFT.
    assert [e for e in stages.events if e[0] == "train"] == [("train", 2, "sft", [1.0])] * 2
    assert monitor.logged[0][1]["train/rft_kept_episode_fraction"] == 0.5
    with pytest.raises(TrainingStalled, match="no episode reached algorithm.rft_reward_threshold = 2"):
        run_loop(settings(total_training_steps=4, algorithm="rft", rft_threshold=2.0, max_idle_steps=2),
                 Recording(), TASKS, [], FakeMonitor())


class LostAt(FakeStages):
    """A worker lost (the trainer still consistent: trainer_ok) in `stage` of step `step`."""

    def __init__(self, stage: str, step: int):
        super().__init__()
        self.lose_stage, self.lose_step, self.step_now = stage, step, 0

    def rollout(self, tasks, validation, step=0, progress=None):
        self.step_now = step
        if self.lose_stage == "rollout" and step == self.lose_step and not validation:
            raise WorkerLost("explorer 0 did not answer", trainer_ok=True)
        return super().rollout(tasks, validation, step)

    def sync_weights(self):
        if self.lose_stage == "sync" and self.step_now == self.lose_step:
            raise WorkerLost("engine 0 died during the sync", trainer_ok=True)
        super().sync_weights()


def test_a_worker_lost_between_steps_saves_the_last_completed_step():
    stages = LostAt("rollout", 3)
    with pytest.raises(WorkerLost):
        run_loop(settings(total_training_steps=6, save_freq=5, val_before_train=False), stages, TASKS, [],
                 FakeMonitor())
    assert [e for e in stages.events if e[0] == "save"] == [("save", 2)]
    assert stages.run_state["step"] == 2


def test_a_worker_lost_in_the_sync_saves_nothing_the_state_does_not_describe():
    # Step 3 trained, then the sync failed: the trainer holds step 3 and the run state says step 2, so a
    # checkpoint now would resume step 3's batch on weights that already learnt it.
    stages = LostAt("sync", 3)
    with pytest.raises(WorkerLost):
        run_loop(settings(total_training_steps=6, save_freq=5, val_before_train=False), stages, TASKS, [],
                 FakeMonitor())
    assert ("train", 4) in stages.events and not [e for e in stages.events if e[0] == "save"]


def test_the_loop_records_the_trainers_logprobs_on_the_samples():
    # Whatever the backbone, the trainer's logprobs before the update reach the samples the log viewer saves.
    class Reporting(FakeStages):
        def train(self, samples, objective="policy"):
            return TrainResult({}, [[-0.25] * len(s.response_ids) if i % 2 else None for i, s in enumerate(samples)])

    class Keeping(FakeMonitor):
        def save_episodes(self, step, episodes, tag, samples=None):
            self.samples = samples

    monitor = Keeping()
    run_loop(settings(total_training_steps=1, val_before_train=False), Reporting(), TASKS, [], monitor)
    assert [s.trainer_logprobs for s in monitor.samples] == [None, [-0.25, -0.25], None, [-0.25, -0.25]]


def test_a_sync_report_reaches_the_steps_metrics():
    class Syncing(FakeStages):
        def sync_weights(self):
            return SyncReport(verified=1.0, verify_s=0.25)

    monitor = FakeMonitor()
    run_loop(settings(total_training_steps=1, val_before_train=False), Syncing(), TASKS, [], monitor)
    [(_, metrics)] = monitor.logged
    assert metrics["sync/verified"] == 1.0 and metrics["time/sync_verify_s"] == 0.25
    assert "time/engine_load_s" not in metrics  # timed by Ray workers only


def test_sync_reports_of_several_engines_combine_to_the_worst():
    a = SyncReport(verified=1.0, verify_s=0.25, engine_load_s=2.0)
    b = SyncReport(verified=0.0, verify_s=0.5, engine_load_s=1.0)
    worst = SyncReport.worst([a, b])
    assert worst.metrics() == {"time/engine_load_s": 2.0, "sync/verified": 0.0, "time/sync_verify_s": 0.5}
    assert SyncReport.worst([SyncReport(), SyncReport()]).metrics() == {}  # nothing measured, nothing logged
    assert SyncReport(total_s=1.5, verified=1.0).figures() == {"total_s": 1.5, "verified": 1.0}


def _timed_out(task, i):
    return Episode(task, i, f"{task.task_id}#{i}", flags=["timeout"], error="episode timed out after 600s",
                   error_summary="episode timed out after 600s", error_source="workflow")


def test_void_note_by_hand():
    from astuner.monitor import void_note

    task = Task("t", "q")
    ok = Episode(task, 0, "ok", calls=[call(1)], reward=1.0, is_success=True)
    failed = Episode(task, 1, "f", flags=["failed"], error_summary="ValueError: boom", error_source="judge")
    assert void_note([_timed_out(task, i) for i in range(32)]) == (
        "32 of 32 timed out (episode timed out after 600s; astuner.rollout.episode_timeout)")
    assert void_note([ok, ok, failed, failed]) is None  # half failed: still a measurement
    assert void_note([ok, failed, failed, _timed_out(task, 3)]) == (
        "1 of 4 timed out (episode timed out after 600s; astuner.rollout.episode_timeout); 2 of 4 failed (the "
        "first: ValueError: boom, in the judge)")
    assert void_note([]) is None


def test_a_void_validation_is_n_a_never_a_score_of_0(caplog):
    """All validation episodes time out: the console says so, val/accuracy is not logged (val/void is), the summary
    keeps no score for that step and says the validation was void."""
    class TimingOut(FakeStages):
        def rollout(self, tasks, validation, step=0, progress=None):
            if validation:
                return [_timed_out(t, 0) for t in tasks]
            return super().rollout(tasks, validation, step, progress)

    monitor = FakeMonitor()
    with caplog.at_level("WARNING", logger="astuner.loop"):
        summary = run_loop(settings(total_training_steps=1), TimingOut(), TASKS, TASKS[:2], monitor)
    val = next(m for _, m in monitor.logged if "val/failure_rate" in m)
    assert val["val/void"] == 1.0 and val["val/failure_rate"] == 1.0 and "val/accuracy" not in val
    assert summary.val_scores == {} and summary.void_validations == [0, 1]  # before training and at its end
    assert "validation void (n/a) at steps 0, 1" in summary.line("run")
    assert ("validation void at step 0: 2 of 2 timed out (episode timed out after 600s; "
            "astuner.rollout.episode_timeout); its accuracy is n/a") in caplog.text


def test_the_progress_bar_shows_a_void_validation_as_n_a(tmp_path):
    from astuner.monitor import Monitor

    monitor = Monitor(tmp_path, total_steps=2, show_progress=False)
    try:
        monitor.log_metrics(0, {"val/accuracy": 0.5})
        assert monitor._postfix["val_acc"] == "0.5"
        monitor.log_metrics(1, {"val/void": 1.0, "val/failure_rate": 1.0})
        assert monitor._postfix["val_acc"] == "n/a"  # not the last measured score, not 0
    finally:
        monitor.close()
