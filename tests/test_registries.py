"""Each choice the config offers is a `Literal` in config/schema.py and a registry in the code that acts on it.
The config cannot import the registries (it sits below them, and `astuner --help` imports no torch), so these
tests keep the two lists equal: a name added to one and not the other fails here, not in a user's run."""

from __future__ import annotations

from typing import get_args

from astuner.config import schema


def literal(section: type, field: str) -> set[str]:
    return set(get_args(section.model_fields[field].annotation))


def test_algorithm_types_are_the_catalog():
    from astuner.algorithm.catalog import ALGORITHMS
    from astuner.selection import SELECTIONS

    assert literal(schema.AlgorithmSection, "type") == set(ALGORITHMS)
    assert {a.selection for a in ALGORITHMS.values()} <= set(SELECTIONS)


def test_catalog_objectives_exist():
    from astuner.algorithm.catalog import ALGORITHMS
    from astuner.algorithm.objectives import TOKEN_OBJECTIVES

    for a in ALGORITHMS.values():
        assert a.objective in TOKEN_OBJECTIVES, a.name
        # A pair objective takes pairs, and only pair data gives them.
        assert TOKEN_OBJECTIVES[a.objective].paired == (a.data == "pairs"), a.name


def test_catalog_keys_are_config_keys():
    from astuner.algorithm.catalog import ALGORITHMS
    from astuner.config import valid_keys

    keys = valid_keys()
    for a in ALGORITHMS.values():
        for k in a.reads:
            assert k in keys or any(v.startswith(k + ".") for v in keys), (a.name, k)


def test_advantage_estimators():
    from astuner.algorithm.registry import ADV_ESTIMATORS

    assert literal(schema.AlgorithmSection, "adv_estimator") == set(ADV_ESTIMATORS)


def test_tool_parsers():
    from astuner.model_tuner.tool_parser import TOOL_PARSERS

    assert literal(schema.RolloutSection, "tool_call_parser") == {"auto", *TOOL_PARSERS}


def test_task_readers():
    from astuner.task_reader import TASK_READERS

    assert literal(schema.TaskReaderSection, "type") == set(TASK_READERS)


def test_engines():
    from astuner.engine.build import ADAPTER_ENGINES, ENGINES

    assert literal(schema.RolloutSection, "engine") == {"auto", *ENGINES}
    assert set(ADAPTER_ENGINES) == set(ENGINES)  # every engine serves adapters on a shared base too


def test_teacher_apis():
    from astuner.config.schema_models import TeacherSection
    from astuner.distill.teachers import TEACHER_APIS

    assert literal(TeacherSection, "api") == set(TEACHER_APIS)


def test_backbones():
    """Each backbone's record names entry points that exist and packaged defaults that exist."""
    import importlib

    from astuner.backbone import BACKBONES
    from astuner.config.compose import DEFAULT_CONFIG_DIR

    assert tuple(BACKBONES) == ("debug", "verl", "trinity")
    for record in BACKBONES.values():
        for entry in filter(None, (record.run, record.offline_run)):
            module, func = entry.split(":")
            assert callable(getattr(importlib.import_module(module), func)), entry
        if record.defaults_file:
            assert (DEFAULT_CONFIG_DIR / record.defaults_file).is_file()


def test_optimizer_steps_per_type():
    from astuner.algorithm.catalog import ALGORITHMS

    # mini_batch_num 3, ppo_epochs 2: RL takes both, SFT-like types the mini-batches, preference pairs one step.
    got = {n: a.optimizer_steps(3, 2) for n, a in ALGORITHMS.items()}
    assert got == {"grpo": 6, "rft": 3, "on_policy_distillation": 6, "sft": 3, "dpo": 1, "orpo": 1}
    assert [n for n, a in ALGORITHMS.items() if a.needs_reference] == ["dpo"]
    assert [n for n, a in ALGORITHMS.items() if a.offline] == ["sft", "dpo", "orpo"]


def test_loss_settings():
    from astuner.algorithm.loss import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_MODES

    assert literal(schema.TrainerCommonSection, "loss_agg_mode") == set(LOSS_AGG_MODES)
    assert literal(schema.TrainerCommonSection, "kl_loss_type") == set(KL_ESTIMATORS)
    assert literal(schema.PolicyLossSection, "loss_mode") == set(POLICY_LOSS_MODES)
