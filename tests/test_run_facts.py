"""config/derived.run_facts: what the set-up reads of the config, resolved once and handed to the builders (the
algorithm's record, the rollout engine, a model teacher's engine), and the start that refuses an engine it cannot
start before any data is read."""

from __future__ import annotations

import pytest
from test_effective_config import YAML  # a run's config: a model, tasks and a workflow

from astuner.algorithm.catalog import algorithm
from astuner.config import derived, load_config
from astuner.errors import UserError

DISTILL = ["astuner.trainer_common.algorithm.type=on_policy_distillation", "astuner.teacher.model=teacher/"]
SFT = ["astuner.trainer_common.algorithm.type=sft", "astuner.offline_data.train_file=rows.jsonl"]


@pytest.fixture
def facts(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    return lambda *overrides: derived.run_facts(load_config(path, list(overrides)).typed)


@pytest.mark.parametrize("installed", [True, False])
def test_auto_is_the_engine_that_is_installed_for_the_rollouts_and_the_teacher(facts, monkeypatch, installed):
    monkeypatch.setattr(derived, "vllm_available", lambda: installed)
    got = facts("astuner.rollout.engine=auto", *DISTILL)
    engine = "vllm" if installed else "hf"
    assert (got.algorithm, got.engine, got.teacher_engine) == (algorithm("on_policy_distillation"), engine, engine)


def test_a_teacher_is_scored_on_its_own_engine_only_where_the_algorithm_has_one(facts, monkeypatch):
    monkeypatch.setattr(derived, "vllm_available", lambda: True)
    assert facts("astuner.rollout.engine=hf", *DISTILL, "astuner.teacher.engine=vllm").teacher_engine == "vllm"
    assert facts("astuner.rollout.engine=vllm", *DISTILL).teacher_engine == "vllm"  # the rollout's
    assert facts("astuner.teacher.model=teacher/").teacher_engine is None  # grpo reads no teacher
    assert facts().algorithm.name == "grpo"


@pytest.mark.parametrize("overrides, key", [
    (["astuner.rollout.engine=vllm"], "astuner.rollout.engine"),
    (["astuner.rollout.engine=hf", *DISTILL, "astuner.teacher.engine=vllm"], "astuner.teacher.engine"),
])
def test_an_engine_that_is_not_installed_is_refused_with_what_to_do(facts, monkeypatch, overrides, key):
    monkeypatch.setattr(derived, "vllm_available", lambda: False)
    with pytest.raises(UserError, match=f"{key}=vllm, but vLLM is not installed.*pip install vllm"):
        facts(*overrides)


def test_offline_data_starts_no_engine_so_none_is_refused(facts, monkeypatch):
    monkeypatch.setattr(derived, "vllm_available", lambda: False)
    got = facts("astuner.rollout.engine=vllm", *SFT)
    assert got.algorithm.offline and got.engine == "vllm"
