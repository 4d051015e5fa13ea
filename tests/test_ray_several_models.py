"""Several trained models (astuner.models) on the Ray backbones, on a real local Ray cluster with the tiny model:
verl's two data-parallel workers and trinity's explorer and trainer worker give the debug backbone's rewards and
both models' weights, a verl run resumes both models exactly, LoRA adapters on one base give the debug backbone's
adapters on trinity, and a sharded strategy with several models exits 2 before any actor starts."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astuner.cli import main
from test_several_models import changed, metric_rows, write_run
from tolerances import ADAM_FLIP_FRACTION, LORA_FLIP_FRACTION, assert_adam_close

RAY = ("astuner.trainer_common.cpus_per_worker=0.5",)
ADAPTERS = "models: {critic: {path: MODEL, lr: 2.0e-3, lora_rank: 4}}\n  agents: {critic: {model: critic}}"
LORA = ("astuner.trainer_common.lora.rank=4", "astuner.trainer_common.lora.alpha=8")


def weights(out: Path, step: int, model: str = "policy") -> dict:
    folder = out / f"global_step_{step}" / model
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(folder / name))


def assert_same_models(ours: Path, theirs: Path, step: int) -> None:
    """Both models' weights after `step` Adam steps equal the debug run's up to summation order (tolerances.py):
    the policy's at lr 1e-3, the critic's at its own 2e-3. A model trained on the other's samples, or twice, or
    not at all, moves most weights by about lr."""
    for model, lr in (("policy", 1e-3), ("critic", 2e-3)):
        a, b = weights(ours, step, model), weights(theirs, step, model)
        assert a.keys() == b.keys()
        for name in a:
            flips = LORA_FLIP_FRACTION if "lora_" in name else ADAM_FLIP_FRACTION  # tests/tolerances.py
            assert_adam_close(a[name], b[name], lr=lr, steps=step, what=f"{model} {name}",
                              flip_fraction=flips)


def assert_resumes_exactly(folder: Path, model_dir: Path, backbone: str, *overrides: str) -> None:
    """The 4-step run in `folder`, stopped after its step-2 checkpoint and resumed: both models' weights (and so
    their Adam moments) at step 4 equal the straight run's to 1e-6."""
    out = folder / "out"
    (out / "global_step_4").rename(folder / "straight_4")
    assert run(folder, model_dir, backbone, *overrides,
               f"astuner.trainer_common.resume_mode={out / 'global_step_2'}", steps=4) == 0
    for model in ("policy", "critic"):
        a, b = weights(out, 4, model), load_file(str(folder / "straight_4" / model / "model.safetensors"))
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=f"resumed {model} {name}")


def run(folder: Path, model_dir: Path, backbone: str, *overrides: str, roster: str | None = None,
        steps: int = 2) -> int:
    yaml = write_run(folder, model_dir, "WriterAndCritic", steps=steps,
                     roster=None if roster is None else roster.replace("MODEL", str(model_dir)))
    return main(["--conf", str(yaml), "--backbone", backbone, *overrides])


@contextlib.contextmanager
def as_ray_workers():
    """torch on one thread, as in the Ray workers (their OMP_NUM_THREADS comes from their fraction of a CPU): the
    debug reference then sums in the workers' order. On more threads it splits reductions otherwise, and on an
    AVX2-only CPU that moved 99% of the critic's tied-head entries past the rounding bound of assert_adam_close
    (2 Adam steps; the workers' weights equal the one-thread debug run's exactly)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("debug")
    with as_ray_workers():
        assert run(folder, tiny_model_dir, "debug", steps=4) == 0
    return folder / "out"


@pytest.mark.slow
def test_verl_two_workers_train_both_models_as_debug_does_and_resume_exactly(cluster, debug_run, tmp_path,
                                                                              tiny_model_dir):
    workers = (*RAY, "astuner.trainer_common.n_gpus_per_node=2")
    assert run(tmp_path, tiny_model_dir, "verl", *workers, steps=4) == 0
    out = tmp_path / "out"
    ours, theirs = metric_rows(out), metric_rows(debug_run)
    # The same episodes (seeds follow the episode, not the worker), each model trained on its own samples ...
    assert [r["train/reward_mean"] for r in ours] == [r["train/reward_mean"] for r in theirs]
    assert [r["model/critic/actor/num_samples"] for r in ours] == [6.0] * 4
    assert all(r["model/critic/actor/lr"] == pytest.approx(2e-3) for r in ours)
    # ... with the gradients of each model summed over the two workers: debug's weights, both models.
    assert_same_models(out, debug_run, 4)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert changed(initial, weights(out, 4)) and changed(initial, weights(out, 4, "critic"))
    assert all(r["sync/verified"] == 1.0 for r in ours)  # every worker's two engines serve their trainers

    assert_resumes_exactly(tmp_path, tiny_model_dir, "verl", *workers)


@pytest.mark.slow
def test_trinity_on_policy_trains_both_models_as_debug_does(cluster, debug_run, tmp_path, tiny_model_dir):
    # The explorer holds both engines; the trainer worker both trainers; each sync sends both models' weights.
    assert run(tmp_path, tiny_model_dir, "trinity", *RAY, "trinity.synchronizer.sync_interval=1", steps=4) == 0
    out = tmp_path / "out"
    ours = metric_rows(out)
    assert [r["train/reward_mean"] for r in ours] == [r["train/reward_mean"] for r in metric_rows(debug_run)]
    assert_same_models(out, debug_run, 4)
    assert [r["trinity/num_syncs"] for r in ours] == [1, 2, 3, 4]


@pytest.mark.slow
def test_trinity_gives_each_model_a_sharded_trainer_group_and_resumes_exactly(cluster, debug_run, tmp_path,
                                                                             tiny_model_dir):
    """trainer_groups: per_model: the policy and the critic each train on two fsdp2 workers of their own, at the
    same time; the explorer gets both models' weights gathered from the shards. Same rewards and weights as the
    debug backbone; the checkpoint holds both models (the critic's written by its own group) and resumes exactly."""
    groups = ("astuner.trainer_common.cpus_per_worker=0.25", "astuner.trainer_common.n_gpus_per_node=2",
              "astuner.trainer_common.strategy=fsdp2", "astuner.trainer_common.trainer_groups=per_model",
              "trinity.synchronizer.sync_interval=1")
    assert run(tmp_path, tiny_model_dir, "trinity", *groups, steps=4) == 0
    out = tmp_path / "out"
    log = (out / "astuner.log").read_text()
    assert "2 trainer workers, strategy fsdp2" in log and "2 trainer workers of model critic, strategy fsdp2" in log
    ours = metric_rows(out)
    assert [r["train/reward_mean"] for r in ours] == [r["train/reward_mean"] for r in metric_rows(debug_run)]
    assert [r["model/critic/actor/num_samples"] for r in ours] == [6.0] * 4
    assert_same_models(out, debug_run, 4)

    assert_resumes_exactly(tmp_path, tiny_model_dir, "trinity", *groups)


@pytest.mark.slow
def test_adapters_on_one_base_on_trinity_equal_debugs(cluster, tmp_path, tiny_model_dir):
    """Policy and critic as LoRA adapters of one base: the explorer holds one engine with both adapters, the
    trainer worker one frozen base under both trainers, and each sync sends the two adapters alone; after 2 steps
    both adapters equal the debug backbone's (verl's workers sync the same way, in process)."""
    with as_ray_workers():
        assert run(tmp_path / "debug", tiny_model_dir, "debug", *LORA, roster=ADAPTERS) == 0
    assert run(tmp_path / "ray", tiny_model_dir, "trinity", *RAY, *LORA, "trinity.synchronizer.sync_interval=1",
               roster=ADAPTERS) == 0
    log = (tmp_path / "ray" / "out" / "astuner.log").read_text()
    assert "model critic: a LoRA adapter on the policy's base" in log
    ours = metric_rows(tmp_path / "ray" / "out")
    assert [r["train/reward_mean"] for r in ours] == [r["train/reward_mean"] for r in
                                                      metric_rows(tmp_path / "debug" / "out")]
    assert_same_models(tmp_path / "ray" / "out", tmp_path / "debug" / "out", 2)


def test_fsdp2_with_several_models_in_one_group_exits_2_before_any_actor(tmp_path, tiny_model_dir, capsys):
    assert run(tmp_path, tiny_model_dir, "verl", "astuner.trainer_common.strategy=fsdp2") == 2
    err = capsys.readouterr().err
    assert "strategy fsdp2 shards one model over the trainer workers" in err and "set the strategy to ddp" in err
    assert run(tmp_path, tiny_model_dir, "verl", "astuner.trainer_common.trainer_groups=per_model") == 2
    assert "verl colocates every model's engine and trainer in each worker" in capsys.readouterr().err


def test_auto_picks_ddp_for_several_models():
    from types import SimpleNamespace

    from astuner.config.schema_models import strategy_of

    def typed(strategy, models):
        tc = SimpleNamespace(strategy=strategy)
        return SimpleNamespace(astuner=SimpleNamespace(trainer_common=tc, models=models))

    assert strategy_of(typed("auto", {"critic": object()}), models_in_group=2) == "ddp"
    assert strategy_of(typed("auto", {"critic": object()}), models_in_group=1) == "auto"  # a group of its own
    assert strategy_of(typed("auto", {})) == "auto"  # one model: fsdp.resolve_strategy decides, as before
    assert strategy_of(typed("fsdp2", {})) == "fsdp2"


def test_the_gpu_estimate_of_several_models_follows_their_placement(tmp_path, tiny_model_dir):
    """vLLM on a card: the run's engines split one share (config.derived.gpu_share_per_engine), so another model adds
    no engine bytes; a model with a sharded trainer group of its own counts its share of the trainer; fsdp2 on a
    LoRA model's own group exits 2 before any worker starts, naming the model."""
    from astuner import preflight
    from astuner.config import load_config
    from astuner.errors import UserError

    yaml = write_run(tmp_path, tiny_model_dir, "WriterAndCritic")
    facts = preflight.read_model_facts(str(tiny_model_dir))
    card = preflight.DeviceFacts("cuda", 80 * 2**30, 80 * 2**30)
    P = facts.num_params

    def plan(*overrides):
        typed = load_config(yaml, ["astuner.rollout.engine=hf", *overrides]).typed
        typed = typed.model_copy(update={"astuner": typed.astuner.model_copy(
            update={"rollout": typed.astuner.rollout.model_copy(update={"engine": "vllm"})})})
        return preflight.make_plan(typed, "trinity", facts, 256, 2, card, {"critic": facts})

    one_group = plan()
    assert one_group.others_bytes == preflight.trainer_bytes(P, "bf16", False)  # its trainer; no engine bytes
    sharded = plan("astuner.trainer_common.trainer_groups=per_model", "astuner.trainer_common.n_gpus_per_node=4",
                   "astuner.trainer_common.strategy=fsdp2")
    assert sharded.others_bytes == preflight.trainer_bytes(P, "bf16", False) // 4
    with pytest.raises(UserError, match=r"strategy \(model critic, a trainer group of its own\).*LoRA"):
        plan("astuner.trainer_common.trainer_groups=per_model", "astuner.trainer_common.strategy=fsdp2",
             "astuner.trainer_common.n_gpus_per_node=2", "+astuner.models.critic.lora_rank=4")


@pytest.mark.slow
def test_a_trinity_trainer_card_is_planned_without_the_explorers_engine(tmp_path, tiny_model_dir):
    """trinity's explorers hold GPUs of their own: a 3B full fine-tuning (bf16, about 52 GiB of weights, gradients
    and AdamW) fits a trainer's 80 GB card even though the engine's share would not fit beside it; colocated
    (verl), the same run is refused with the engine's share counted."""
    from astuner import preflight
    from astuner.config import load_config
    from astuner.errors import UserError

    yaml = write_run(tmp_path, tiny_model_dir, "WriterAndCritic", roster="")
    facts = preflight.ModelFacts(str(tiny_model_dir), "Qwen2ForCausalLM", 3_090_000_000, 32768)
    card = preflight.DeviceFacts("cuda", 79 * 2**30, 80 * 2**30)

    def plan(backbone):
        typed = load_config(yaml, ["astuner.rollout.engine=hf", "astuner.rollout.gpu_memory_utilization=0.6"]).typed
        typed = typed.model_copy(update={"astuner": typed.astuner.model_copy(
            update={"rollout": typed.astuner.rollout.model_copy(update={"engine": "vllm"})})})
        return preflight.make_plan(typed, backbone, facts, 4096, 2, card)

    apart = plan("trinity")
    assert apart.engine_apart and apart.weights_bytes == apart.trainer_bytes  # the explorer's share not on this card
    preflight.check_fits(apart, facts)
    assert "on GPUs of its own" in apart.block(facts)
    together = plan("verl")
    assert not together.engine_apart and together.weights_bytes == together.trainer_bytes + together.engine_bytes
    with pytest.raises(UserError, match="needs about 100 GiB"):
        preflight.check_fits(together, facts)
