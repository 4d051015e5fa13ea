"""A long phase (an engine start, the warm start's check) says what it is doing; a short one says nothing."""

from __future__ import annotations

import time

import pytest

from astuner.phase import phase


def test_a_long_phase_is_said_while_it_runs_and_when_it_ends():
    lines = []
    with phase("starting the vllm engine", after_s=0.2, every_s=0.2, say=lines.append):
        time.sleep(0.7)
    assert len(lines) >= 3 and all(line.startswith("starting the vllm engine: ") for line in lines)
    assert lines[0].endswith("s so far") and lines[-1].startswith("starting the vllm engine: done after")


def test_a_short_phase_says_nothing_and_a_failed_one_says_it_stopped():
    lines = []
    with phase("quick", after_s=5, say=lines.append):
        pass
    assert lines == []
    with pytest.raises(RuntimeError), phase("failing", after_s=0.1, say=lines.append):
        time.sleep(0.3)
        raise RuntimeError("boom")
    assert lines[-1].startswith("failing: stopped after")


def test_an_engine_start_runs_in_a_phase(monkeypatch):
    from astuner.engine import build

    seen = []
    monkeypatch.setattr("astuner.phase._say", seen.append)
    monkeypatch.setitem(build.ENGINES, "hf", lambda *args: time.sleep(0.3) or "engine")
    monkeypatch.setattr("astuner.phase.AFTER_S", 0.1)
    assert build.build_engine(None, "/models/tiny", None, 256, engine="hf") == "engine"
    assert seen and seen[0].startswith("starting the hf engine (tiny, max_model_len 256)")
