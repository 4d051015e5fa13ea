"""The watchdog names the stuck stage and what it waits on; a stage past its deadline stops the run."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import pytest
from test_loop import TASKS, FakeMonitor, FakeStages, settings

from astuner.errors import StageTimeout
from astuner.loop import run_loop
from astuner.types import TrainResult
from astuner.watchdog import STOP_SIGNAL, Watchdog, pending, watch


def test_pending_names_the_oldest_item_and_where_it_is_now():
    seen = {}

    async def episode(name, inner, hold):
        with watch("episode", name):
            await asyncio.sleep(0.01)
            if inner:
                with watch(*inner):
                    await hold.wait()
            else:
                await hold.wait()

    async def main():
        hold = asyncio.Event()
        jobs = [asyncio.ensure_future(episode("train:t0#0", ("judge", "MathJudge"), hold)),
                asyncio.ensure_future(episode("train:t1#0", None, hold))]
        await asyncio.sleep(0.05)
        seen["text"] = pending(now=time.monotonic() + 100)
        hold.set()
        await asyncio.gather(*jobs)
        seen["after"] = pending()

    asyncio.run(main())
    # The judge runs inside the first episode (a context variable links them), the other episode is counted.
    assert seen["text"].startswith("oldest pending: episode train:t0#0 for 100 s, now in judge MathJudge for 100 s")
    assert seen["text"].endswith("(1 more pending)")
    assert seen["after"] == ""


def test_a_slow_step_is_reported_with_its_stage_and_item(caplog):
    lines = []
    dog = Watchdog(factor=3.0, min_steps=2, on_slow=lines.append)
    dog.durations = [10.0, 12.0]  # median 11 s
    dog.step_started(3)
    t0 = dog._step_start
    with dog.stage("rollout"), watch("tool", "find_badge"), caplog.at_level(logging.WARNING):
        dog.check(now=t0 + 30)  # under 3 x 11 s
        assert lines == []
        dog.check(now=t0 + 40)
        dog.check(now=t0 + 60)  # not again until the step's time doubles
        dog.check(now=t0 + 81)
    assert len(lines) == 2
    assert lines[0].startswith("step 3 stage rollout for 40 s; oldest pending: tool find_badge for 40 s")
    assert "3.6x the median step (11 s)" in lines[0]
    assert "watchdog: step 3 stage rollout" in caplog.text


def test_no_report_before_enough_steps_to_know_the_median():
    lines = []
    dog = Watchdog(min_steps=2, on_slow=lines.append)
    dog.durations = [1.0]
    dog.step_started(2)
    with dog.stage("train"):
        dog.check(now=dog._step_start + 1000)
    assert lines == []


def test_a_stage_past_its_deadline_stops_the_run_naming_what_it_waited_on():
    class Stuck(FakeStages):
        def train(self, samples, objective="policy"):
            with watch("actor", "trainer 0 to train a step"):
                time.sleep(30)  # a hang: only the watchdog's interrupt ends it
            return TrainResult({}, [None] * len(samples))

    started = time.monotonic()
    with pytest.raises(StageTimeout) as caught:
        run_loop(settings(total_training_steps=2, stage_timeout_s=0.4), Stuck(), TASKS, [], FakeMonitor())
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "step 1 stage train for" in message
    assert "oldest pending: actor trainer 0 to train a step" in message
    assert "astuner.trainer_common.stage_timeout_s = 0.4 s" in message


def test_ctrl_c_stays_an_interrupt():
    dog = Watchdog(deadline_s=100)
    with pytest.raises(KeyboardInterrupt), dog.stage("rollout"):
        raise KeyboardInterrupt


def test_a_rollout_reports_the_tool_its_agent_is_running(demo_tokenizer):
    import threading

    from test_rollout import TASKS as ROLLOUT_TASKS
    from test_rollout import TextEngine, runner

    from astuner.workflow import Workflow, WorkflowOutput

    schema = {"type": "function", "function": {"name": "find_badge", "description": "Badge of a person.",
                                               "parameters": {"type": "object", "properties": {
                                                   "name": {"type": "string"}}, "required": ["name"]}}}
    running = threading.Event()

    class ToolAgent(Workflow):
        async def execute(self, workflow_task, model_tuner):
            await model_tuner.chat([{"role": "user", "content": "Badge of Ada?"}], tools=[schema])
            running.set()
            await asyncio.sleep(1.0)  # the agent runs its tool
            return WorkflowOutput(reward=1.0)

    call = '<tool_call>\n{"name": "find_badge", "arguments": {"name": "Ada"}}\n</tool_call>'
    r, _ = runner(demo_tokenizer, ToolAgent, engine=TextEngine(demo_tokenizer, reply=lambda p: call),
                  num_repeat=1, max_env_worker=1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(r.run(ROLLOUT_TASKS[:1])))
    thread.start()
    assert running.wait(30)
    report = pending()
    thread.join(30)
    assert report.startswith("oldest pending: episode train:t1#0 for ")
    assert ", now in tool find_badge for " in report
    assert seen[0][0].reward == 1.0 and pending() == ""


def test_a_run_in_another_thread_times_out_there_and_leaves_the_main_thread_alone():
    import threading

    class Stuck(FakeStages):
        def train(self, samples, objective="policy"):
            for _ in range(300):  # a Python-level wait: an exception sent to a thread lands between instructions
                time.sleep(0.1)
            return TrainResult({}, [None] * len(samples))

    caught = []

    def run():
        try:
            run_loop(settings(total_training_steps=2, stage_timeout_s=0.4), Stuck(), TASKS, [], FakeMonitor())
        except StageTimeout as exc:
            caught.append(exc)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    thread.join(20)
    assert caught and "step 1 stage train" in str(caught[0])
    assert time.monotonic() - started < 10


def test_an_interrupt_that_lands_as_the_stage_ends_is_still_the_timeout():
    dog = Watchdog(deadline_s=100)

    class Lock:  # the interrupt arrives while the ending stage waits for the lock
        entered = 0

        def __enter__(self):
            Lock.entered += 1
            if Lock.entered == 2:
                dog._expired = "step 1 stage train for 101 s"
                raise KeyboardInterrupt

        def __exit__(self, *exc):
            return False

    dog._lock = Lock()
    with pytest.raises(StageTimeout, match="stage train"), dog.stage("train"):
        pass


class BlockedInC(FakeStages):
    def train(self, samples, objective="policy"):
        time.sleep(30)  # one blocking call: an exception sent to the thread would land only after it returns
        return TrainResult({}, [None] * len(samples))


@pytest.mark.parametrize("sigint", ["ignored", "foreign handler"])
def test_a_blocking_stage_meets_its_deadline_whatever_sigint_does(sigint):
    """SIGINT ignored is what `nohup ... &` leaves; a foreign handler is what a framework (or pytest) installs.
    Either way the watchdog's own signal ends the blocking sleep, and the run stops in about the deadline."""
    handler = signal.SIG_IGN if sigint == "ignored" else (lambda signum, frame: None)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        started = time.monotonic()
        with pytest.raises(StageTimeout, match="step 1 stage train"):
            run_loop(settings(total_training_steps=2, stage_timeout_s=0.4), BlockedInC(), TASKS, [], FakeMonitor())
        assert time.monotonic() - started < 10
        assert signal.getsignal(signal.SIGINT) is handler  # SIGINT left as it was
    finally:
        signal.signal(signal.SIGINT, previous)


def _child_ignores_stop_signal() -> bool:
    """Whether a child started now ignores STOP_SIGNAL: its SigIgn mask, as inherited across exec."""
    import subprocess

    line = subprocess.run(["grep", "SigIgn", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    return bool(int(line.split()[1], 16) >> (STOP_SIGNAL - 1) & 1)


def _mine(signum, frame):
    pass


@pytest.mark.parametrize("before", [signal.SIG_DFL, signal.SIG_IGN, _mine], ids=["default", "ignored", "handler"])
def test_the_watchdog_puts_the_stop_signals_disposition_back_and_children_never_inherit_it_ignored(before):
    """One handler for the run (never SIG_IGN, which every later subprocess would inherit), and the disposition
    the process had before, the default included, once the watchdog exits."""
    previous = signal.signal(STOP_SIGNAL, before)
    try:
        with Watchdog(deadline_s=100) as dog:
            for stage in ("rollout", "train"):
                with dog.stage(stage):
                    assert signal.getsignal(STOP_SIGNAL) not in (before, signal.SIG_IGN, signal.SIG_DFL)
                    assert not _child_ignores_stop_signal()
            assert not _child_ignores_stop_signal()  # between stages too
        assert signal.getsignal(STOP_SIGNAL) is before
        assert _child_ignores_stop_signal() == (before is signal.SIG_IGN)
    finally:
        signal.signal(STOP_SIGNAL, previous)


def test_a_stop_signal_outside_an_expired_stage_is_dropped():
    """A stop that lands after its stage ended (or any stray one) neither raises nor ends the process."""
    with Watchdog(deadline_s=100) as dog:
        signal.pthread_kill(threading.main_thread().ident, STOP_SIGNAL)
        with dog.stage("train"):
            signal.pthread_kill(threading.main_thread().ident, STOP_SIGNAL)  # running, not expired
            time.sleep(0.05)


PENDING_STOP_SCRIPT = """
import signal, threading
from astuner.watchdog import STOP_SIGNAL, Watchdog
with Watchdog(deadline_s=100) as dog, dog.stage("train"):
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})
    signal.pthread_kill(threading.main_thread().ident, STOP_SIGNAL)  # sent, not yet delivered
signal.pthread_sigmask(signal.SIG_UNBLOCK, {STOP_SIGNAL})  # would meet the default disposition: the end
print("alive")
"""


def test_a_stop_still_undelivered_when_the_watchdog_exits_does_not_end_the_process():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PENDING_STOP_SCRIPT], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr


def test_validation_after_the_step_is_not_timed_as_the_step_but_still_named():
    lines = []
    dog = Watchdog(on_slow=lines.append)
    dog.durations = [10.0, 12.0]
    dog.step_started(4)
    dog.step_finished()
    with dog.stage("validation"):
        dog.check(now=dog._step_start + 1000)
        assert dog.status(now=dog._stage_start + 5).startswith("step 4 stage validation for 5 s")
    assert lines == []
