"""config/effective.py: the settings builders copy the config without conditions, because every key that does
nothing under the chosen settings already reads its neutral value there."""

from __future__ import annotations

import pytest

from astuner.algorithm.catalog import algorithm
from astuner.config import load_config
from astuner.config.effective import NEUTRAL
from astuner.config.effective import effective as view

YAML = """\
astuner:
  model: {path: demo:smollm2-135m-instruct}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file: {training: {file_path: train.jsonl}}
  rollout: {agentscope_workflow: "wf.py->W", top_k: 20, top_p: 0.8}
  trainer_common:
    kl_loss_coef: 0.5
    kl_loss_type: k1
    clip_ratio_c: 5.0
    optim: {min_lr_ratio: 0.3}
    algorithm: {epsilon: 0.01, rft_reward_threshold: 0.7, filter_groups: {metric: acc, max_num_gen_batches: 4}}
"""


def effective(typed):
    return view(typed, algorithm(typed.astuner.trainer_common.algorithm.type))


@pytest.fixture
def typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    return lambda *overrides: load_config(path, list(overrides)).typed


def test_inactive_keys_read_neutral_values(typed):
    tc = effective(typed()).astuner.trainer_common  # KL off, constant lr, grpo without dynamic sampling
    assert (tc.kl_loss_coef, tc.kl_loss_type, tc.optim.min_lr_ratio) == (0.0, "k3", 0.0)
    assert (tc.algorithm.filter_groups.metric, tc.algorithm.filter_groups.max_num_gen_batches) == ("score", 0)
    assert tc.algorithm.rft_reward_threshold == 1.0
    # Active under these settings: kept as given.
    assert tc.clip_ratio_c == 5.0 and tc.algorithm.norm_adv_by_std_in_grpo and tc.algorithm.epsilon == 0.01


def test_active_keys_keep_their_values(typed):
    tc = effective(typed("astuner.trainer_common.use_kl_loss=true",
                         "astuner.trainer_common.optim.lr_scheduler_type=cosine",
                         "astuner.trainer_common.algorithm.type=rft",
                         "astuner.trainer_common.algorithm.filter_groups.enable=true")).astuner.trainer_common
    assert (tc.kl_loss_coef, tc.kl_loss_type, tc.optim.min_lr_ratio) == (0.5, "k1", 0.3)
    assert (tc.algorithm.filter_groups.metric, tc.algorithm.filter_groups.max_num_gen_batches) == ("acc", 4)
    assert tc.algorithm.rft_reward_threshold == 0.7


def test_rules_are_decided_on_the_config_as_given(typed):
    # rloo does not divide by the std: norm_adv_by_std_in_grpo and epsilon both go neutral, although epsilon's
    # rule reads norm_adv_by_std_in_grpo, which is reset in the same pass.
    tc = effective(typed("astuner.trainer_common.algorithm.adv_estimator=rloo")).astuner.trainer_common
    assert (tc.algorithm.norm_adv_by_std_in_grpo, tc.algorithm.epsilon) == (False, 0.0)
    tc = effective(typed("astuner.trainer_common.policy_loss.loss_mode=gspo")).astuner.trainer_common
    assert tc.clip_ratio_c == 3.0


def test_offline_types_sample_through_no_filter(typed):
    rollout = effective(typed("astuner.trainer_common.algorithm.type=sft")).astuner.rollout
    assert (rollout.top_k, rollout.top_p) == (0, 1.0)
    rollout = effective(typed()).astuner.rollout
    assert (rollout.top_k, rollout.top_p) == (20, 0.8)


def test_the_given_config_is_not_changed(typed):
    given = typed()
    effective(given)
    assert given.astuner.trainer_common.kl_loss_coef == 0.5


def test_settings_builders_read_the_effective_config(typed):
    from astuner.loop import LoopSettings

    s = LoopSettings.from_config(typed("astuner.trainer_common.algorithm.adv_estimator=rloo")).selection
    assert (s.norm_adv_by_std, s.adv_epsilon, s.filter_metric, s.rft_threshold) == (False, 0.0, "score", 1.0)


def test_every_neutral_key_has_an_applicability_rule():
    from astuner.config.applicability import APPLIES_ONLY_WITH

    assert set(NEUTRAL) <= set(APPLIES_ONLY_WITH)
