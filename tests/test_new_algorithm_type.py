"""docs/architecture.md names where a new algorithm type goes: a record in algorithm/catalog.py, its objective in
algorithm/objectives.py's TOKEN_OBJECTIVES, and its name in the config's Literal. This test adds a toy type by
touching only the two registries (it builds the loop's settings itself instead of extending the Literal) and
trains it through the real loop, stages, trainer and engine: nothing else may need to know the name."""

from __future__ import annotations

import dataclasses

import torch
from test_debug_backbone import write_run
from test_loop import FakeMonitor

from astuner.algorithm.catalog import ALGORITHMS, AlgorithmType
from astuner.algorithm.objectives import TOKEN_OBJECTIVES, TokenBatch, TokenObjective
from astuner.backbone.debug import InProcessStages
from astuner.config import load_config
from astuner.loop import LoopSettings, run_loop
from astuner.run_models import build_runtime


class AdvantageWeightedNLL(TokenObjective):
    """L = -sum_t w_t * A_t * logp_t: the toy objective (no ratio, no clip)."""

    name = "awr"
    loss_metric = "awr_loss"
    trains_zero_advantage = False

    @classmethod
    def from_settings(cls, settings) -> AdvantageWeightedNLL:
        return cls()

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return -(batch.weights_R * batch.advantages_R * batch.logprobs_R).sum(), {}


def test_a_new_algorithm_type_trains_through_the_registries_alone(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(TOKEN_OBJECTIVES, "awr", AdvantageWeightedNLL)
    monkeypatch.setitem(ALGORITHMS, "awr", AlgorithmType("awr", "advantage-weighted NLL on rollouts", "rollouts",
                                                         "awr", "policy_gradient"))
    loaded = load_config(write_run(tmp_path, tiny_model_dir), [f"astuner.experiment_dir={tmp_path / 'out'}"])
    settings = LoopSettings.from_config(loaded.typed)
    settings = dataclasses.replace(settings, selection=dataclasses.replace(settings.selection, algorithm="awr"),
                                   total_training_steps=1, val_before_train=False)
    rt = build_runtime(loaded)
    stages = InProcessStages(rt.runner, rt.trainer, rt.engine, tmp_path / "out", rt.tokenizer)
    before = {n: p.detach().clone() for n, p in rt.trainer.model.named_parameters()}
    monitor = FakeMonitor()
    try:
        run_loop(settings, stages, rt.train_tasks, [], monitor)
    finally:
        stages.shutdown()
    [(step, metrics)] = [(s, m) for s, m in monitor.logged if "actor/awr_loss" in m]
    assert step == 1 and metrics["actor/grad_norm"] > 0
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in rt.trainer.model.named_parameters())
    assert moved > 0  # the toy objective's gradient reached the weights
