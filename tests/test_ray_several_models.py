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
from astuner.memory import DeviceFacts
from astuner.logview import store
from test_several_models import changed, metric_rows, write_run
from tolerances import ADAM_FLIP_FRACTION, LORA_FLIP_FRACTION, assert_adam_close

RAY = ("astuner.trainer_common.cpus_per_worker=0.5",)
ADAPTERS = "models: {critic: {path: MODEL, lr: 2.0e-3, lora_rank: 4}}\n  agents: {critic: {model: critic}}"
LORA = ("astuner.trainer_common.lora.rank=4", "astuner.trainer_common.lora.alpha=8")


def weights(out: Path, step: int, model: str = "policy") -> dict:
    folder = out / f"global_step_{step}" / model
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(folder / name))


LR = {"policy": 1e-3, "critic": 2e-3}  # write_run's learning rates


def assert_model_close(ours: dict, theirs: dict, model: str, steps: int, what: str) -> None:
    """One model's weights after `steps` Adam steps at its lr, equal up to summation order (tolerances.py)."""
    assert ours.keys() == theirs.keys()
    for name in ours:
        flips = LORA_FLIP_FRACTION if "lora_" in name else ADAM_FLIP_FRACTION
        assert_adam_close(ours[name], theirs[name], lr=LR[model], steps=steps, what=f"{what} {model} {name}",
                          flip_fraction=flips)


def sampled(out: Path) -> dict[int, dict]:
    """step -> {(episode uid, agent, call): sampled token ids} of a run's training episodes (its log store)."""
    by_step: dict[int, dict] = {}
    with contextlib.closing(store.connect(out / store.FILE_NAME, readonly=True)) as db:
        for step in {r["step"] for r in store.steps(db) if r["split"] == "train"}:
            for item in store.episodes(db, "train", step, page_size=10_000)["items"]:
                for call in store.episode(db, item["id"])["calls"]:
                    by_step.setdefault(step, {})[(item["uid"], call["agent"], call["idx"])] = call["tokens"]["ids"]
    return by_step


# Which calls each model's weights depend on: the policy's on the writer's drafts; the critic's on its reviews,
# whose prompts hold the drafts.
DEPENDS_ON = {"policy": ("writer",), "critic": ("writer", "critic")}


def steps_sampled_alike(a: dict, b: dict, agents: tuple[str, ...], steps: int) -> int:
    """How many steps two runs (`sampled`) sampled the same tokens in, in the calls of `agents`."""

    def ids(run: dict, step: int) -> dict | None:
        return {k: v for k, v in run[step].items() if k[1] in agents} if step in run else None

    agree = 0
    while agree < steps and ids(a, agree + 1) is not None and ids(a, agree + 1) == ids(b, agree + 1):
        agree += 1
    return agree


def assert_same_models(ours: Path, theirs: Path, steps: int) -> None:
    """The two runs sample the same tokens, get the same rewards and leave both models' weights equal up to
    summation order (tolerances.py): the policy's at lr 1e-3, the critic's at its own 2e-3. A model trained on the
    other's samples, or twice, or not at all, moves most weights by about lr.

    The weights differ by rounding, so a later step may draw another token where the two runs' probabilities
    straddle the sampler's uniform draw (the random tiny model is nearly uniform over 49,152 tokens; on one CPU
    the critic's review at step 3 of a sharded run), and from there the runs part. So each model is compared after
    the last step whose tokens it depends on were sampled alike (a checkpoint every step: `run`), at least 2."""
    a, b = sampled(ours), sampled(theirs)
    for model in LR:
        step = steps_sampled_alike(a, b, DEPENDS_ON[model], steps)
        assert step >= 2, f"{model}: the runs sampled other tokens from step {step + 1} on"
        if model == "policy":
            rewards = [[r["train/reward_mean"] for r in metric_rows(out)[:step]] for out in (ours, theirs)]
            assert rewards[0] == rewards[1]
        assert_model_close(weights(ours, step, model), weights(theirs, step, model), model, step, f"step {step}:")


def assert_resumes_exactly(folder: Path, model_dir: Path, backbone: str, *overrides: str) -> None:
    """The 4-step run in `folder`, stopped after its step-2 checkpoint and resumed: steps 3 and 4 replay the same
    episodes, and both models' weights at step 4 are the straight run's up to the rounding of the engine's
    logprobs (the PPO ratio's denominator), which depends on how the engine happened to batch the calls. On some
    CPUs that rounding moves a few of the tied head's entries along Adam's sign-flip path (tolerances.py), so the
    bound is assert_adam_close's over the 2 resumed steps. A lost optimizer state (a fresh Adam's first step is
    +-lr), a step count off by one (bias correction 20% away) or other episodes move most entries past it."""
    out, straight_out = folder / "out", folder / "straight"
    straight_out.mkdir()
    (out / "global_step_4").rename(straight_out / "global_step_4")
    straight = metric_rows(out)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert run(folder, model_dir, backbone, *overrides,
               f"astuner.trainer_common.resume_mode={out / 'global_step_2'}", steps=4) == 0
    resumed = {r["step"]: r for r in metric_rows(out)}  # the resumed steps' rows, whether replaced or appended
    for r in straight[2:]:
        assert resumed[r["step"]]["train/reward_mean"] == r["train/reward_mean"], f"step {r['step']}: other episodes"
    for model in LR:
        assert_model_close(weights(out, 4, model), weights(straight_out, 4, model), model, 2, "resumed")


def run(folder: Path, model_dir: Path, backbone: str, *overrides: str, roster: str | None = None,
        steps: int = 2) -> int:
    yaml = write_run(folder, model_dir, "WriterAndCritic", steps=steps,
                     roster=None if roster is None else roster.replace("MODEL", str(model_dir)))
    # A checkpoint every step: assert_same_models compares the weights after any step.
    return main(["--conf", str(yaml), "--backbone", backbone, "astuner.trainer_common.save_freq=1", *overrides])


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
    ours = metric_rows(out)
    # The same episodes (seeds follow the episode, not the worker), each model trained on its own samples ...
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
    card = DeviceFacts("cuda", 80 * 2**30, 80 * 2**30)
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
    card = DeviceFacts("cuda", 79 * 2**30, 80 * 2**30)

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
