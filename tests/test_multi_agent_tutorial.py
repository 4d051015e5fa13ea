"""The multi-agent tutorial (tutorial/multi_agent/) trained 2 steps through the CLI on the tiny random model, with
the tutorial's YAMLs: two models (two_agents.yaml) and two LoRA adapters on one base (two_adapters.yaml).

The tiny model cannot write a tool call, so in two_agents.yaml every call is scripted (tests/scripted_engine.py:
forced token by token and scored by the serving model itself): the finder calls find_badge and boxes the badge, the
keeper calls lookup_code and boxes the code on an episode's repeat 0, the badge on repeat 1. The rest is the real
pipeline: two engines, the roster, both agents' tools, per-agent rewards and per-model training."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from safetensors.torch import load_file
from scripted_engine import hermes_call, install

from conftest import REPO

TUTORIAL = REPO / "tutorial" / "multi_agent"


def box_badge(prompt: str) -> str:
    badge = re.findall(r"has badge (\d{4})\.", prompt)[-1]
    return f"The badge is \\boxed{{{badge}}}."


def box_code_on_repeat_0(prompt: str, request_id: str) -> str:
    code, badge = re.findall(r"access code ([A-Z]{2}-\d{4})\.", prompt)[-1], re.findall(r"Badge (\d{4})", prompt)[-1]
    return f"The code is \\boxed{{{code if request_id.split('/')[0].endswith('#0') else badge}}}."


# Call indices of an episode (both agents count in one sequence): finder 0, 1; keeper 2, 3.
SCRIPT = {0: hermes_call("find_badge", "name", r"access code of ([A-Z][a-z]+ [A-Z][a-z]+)\?"), 1: box_badge,
          2: hermes_call("lookup_code", "badge", r"kept for badge (\d{4})\?"), 3: box_code_on_repeat_0}
SHORT = ["astuner.rollout.engine=hf", "astuner.data.train_batch_size=2", "astuner.rollout.num_repeat=2",
         "astuner.rollout.max_response_length_in_one_turn=40", "astuner.rollout.compute_madness_checklist=[]",
         "astuner.trainer_common.val_before_train=false", "astuner.trainer_common.total_training_steps=2",
         "astuner.trainer_common.test_freq=99", "astuner.trainer_common.save_freq=2"]


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tutorial" / "agent_quickstart"))
    yield
    for name in ("lookup_task", "two_agents", "openai_agent"):
        sys.modules.pop(name, None)


def rows(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/failure_rate" in r]


@pytest.mark.slow
def test_two_models_each_agent_trains_its_own(tmp_path, tiny_model_dir, monkeypatch, on_path):
    from astuner.cli import main

    engines = install(monkeypatch, SCRIPT)
    run = tmp_path / "two"
    assert main(["--conf", str(TUTORIAL / "two_agents.yaml"), "--backbone", "debug", f"astuner.experiment_dir={run}",
                 f"astuner.model.path={tiny_model_dir}", f"astuner.models.keeper.path={tiny_model_dir}",
                 *SHORT]) == 0
    assert len(engines) == 2  # the finder's (policy) and the keeper's
    for row in rows(run):
        assert row["train/failure_rate"] == 0
        assert row["train/metrics/finder_success"] == 1.0  # every finder boxed the right badge
        assert row["train/metrics/keeper_success"] == 0.5 and row["train/success_rate"] == 0.5
        assert row["agent/finder/tool_calls_per_episode"] == 1 and row["agent/keeper/tool_calls_per_episode"] == 1
        assert row["model/policy/actor/num_samples"] > 0 and row["model/keeper/actor/num_samples"] > 0
    trajectories = [json.loads(x) for x in (run / "trajectories" / "train_step_000002.jsonl").read_text().splitlines()]
    for e in trajectories:
        assert [c["agent"] for c in e["calls"]] == ["finder", "finder", "keeper", "keeper"]
    # The finder's reward is the same in every episode (no signal): only the keeper's model moved.
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    finder = load_file(str(run / "global_step_2" / "policy" / "model.safetensors"))
    keeper = load_file(str(run / "global_step_2" / "keeper" / "model.safetensors"))
    assert all(torch.equal(finder[n], initial[n]) for n in initial)
    assert any(not torch.equal(keeper[n], initial[n]) for n in initial)


@pytest.mark.slow
def test_two_adapters_on_one_base_run(tmp_path, tiny_model_dir, on_path):
    from astuner.cli import main

    run = tmp_path / "adapters"
    assert main(["--conf", str(TUTORIAL / "two_adapters.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={run}", f"astuner.model.path={tiny_model_dir}",
                 f"astuner.models.keeper.path={tiny_model_dir}", *SHORT]) == 0
    assert "model keeper: a LoRA adapter on the policy's base" in (run / "astuner.log").read_text()
    assert len(rows(run)) == 2
    assert (run / "global_step_2" / "keeper" / "adapter_model.safetensors").is_file()
