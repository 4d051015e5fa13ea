"""FSDP2 sharding of the trainer (astuner/trainer/fsdp.py): two gloo workers on CPU, tiny model.

The Ray test (test_ray_backbones.py) runs whole verl runs sharded and resumes them; here the trainer alone meets
the case a run rarely shows: workers with different numbers of micro-batches (so one must pad to join the
others' collectives), with the KL reference model and the recomputed old logprobs sharded too."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from astuner.trainer.fsdp import resolve_strategy
from astuner.types import Sample
from tolerances import assert_adam_close, eps, rounding_rtol

SETTINGS = dict(
    lr=1e-3, weight_decay=0.01, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2, clip_ratio_high=0.28,
    use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", loss_agg_mode="token-mean", norm_length=16,
    # 25 tokens a micro-batch: the long episode goes alone, the short ones two by two (step_plan.split_micro_batches)
    max_token_len_per_micro_batch=25, mini_batch_num=1, old_logprobs="trainer", device="cpu",
)


def samples() -> list[Sample]:
    """One 60-token episode and three of 10 tokens. Ownership balances tokens (data_parallel.owners): rank 0 gets
    the long one (1 micro-batch), rank 1 the three short ones (2 micro-batches)."""
    def sample(uid: str, n: int, adv: float) -> Sample:
        prompt = [(7 * i + len(uid)) % 900 + 5 for i in range(n // 2)]
        response = [(11 * i + 3) % 900 + 5 for i in range(n - n // 2)]
        return Sample(prompt, response, [-1.0] * len(response), adv, 1.0, uid)

    return [sample("long", 60, 1.0), sample("b", 10, -0.5), sample("c", 10, 0.7), sample("d", 10, -1.2)]


def held_bytes() -> int:
    """Bytes of every tensor storage alive in this process (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on some lazily imported torch modules warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                storage = (obj.to_local() if isinstance(obj, DTensor) else obj).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def worker(rank: int, world: int, port: int, model_dir: str, out: str, strategy: str, precision: str) -> None:
    from astuner.trainer.data_parallel import DataParallel
    from astuner.trainer import Trainer

    before = held_bytes()
    # Built as trainer/build.py's build_trainer builds a worker: knowing the group, so the model stays on the host until sharded.
    trainer = Trainer(model_dir, **SETTINGS, precision=precision, strategy=strategy, group_size=world)
    whole = [weakref.ref(p) for p in (*trainer.model.parameters(), *trainer.ref_model.parameters())]
    used = trainer.join_group(DataParallel.init(rank, world, "127.0.0.1", port, "cpu", 120.0))
    start = {"held": held_bytes() - before, "alive": sum(r() is not None for r in whole),
             "params": sum(p.numel() for p in trainer.model.parameters())}
    metrics = [trainer.train_step(samples()) for _ in range(2)]
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.model.parameters())
    weights = {name: t.clone() for name, t in trainer.named_parameters_for_sync()}  # every rank gathers
    trainer.save_checkpoint(f"{out}.checkpoint", run_state={"step": 2}, write=rank == 0)  # every rank gathers
    buffers = {f"{which}.{name}": b.clone() for which, model in (("model", trainer.model), ("ref", trainer.ref_model))
               for name, b in model.named_buffers()}
    if rank == 0:
        torch.save({"strategy": used, "metrics": metrics, "weights": weights, "local": local, "buffers": buffers}, out)
    torch.save({"local": local, "start": start}, f"{out}.{rank}")
    torch.distributed.barrier()  # no worker tears the group down while another still uses it
    DataParallel.close()


def run_group(tmp_path, model_dir, strategy: str, precision: str = "fp32") -> dict:
    from astuner.trainer.data_parallel import free_port

    port = free_port("127.0.0.1")
    out = str(tmp_path / f"{strategy}.pt")
    mp.start_processes(worker, args=(2, port, str(model_dir), out, strategy, precision), nprocs=2, start_method="spawn")
    result = torch.load(out, weights_only=False)
    result["locals"] = [torch.load(f"{out}.{r}")["local"] for r in range(2)]
    result["starts"] = [torch.load(f"{out}.{r}")["start"] for r in range(2)]
    return result


def test_strategy_rule():
    assert resolve_strategy("auto", 2, "cuda", lora=False) == "fsdp2"
    assert resolve_strategy("auto", 2, "cpu", lora=False) == "ddp"
    assert resolve_strategy("auto", 1, "cuda", lora=False) == "ddp"
    assert resolve_strategy("auto", 2, "cuda", lora=True) == "ddp"
    assert resolve_strategy("fsdp2", 2, "cpu", lora=False) == "fsdp2"
    with pytest.raises(ValueError, match="strategy ddp"):
        resolve_strategy("fsdp2", 2, "cuda", lora=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_two_sharded_workers_take_the_one_process_steps(tmp_path, tiny_model_dir, precision):
    from transformers import AutoModelForCausalLM

    from astuner.trainer import Trainer

    sharded = run_group(tmp_path, tiny_model_dir, "fsdp2", precision)
    assert sharded["strategy"] == "fsdp2"
    one = Trainer(str(tiny_model_dir), **SETTINGS, precision=precision)
    reference = [one.train_step(samples()) for _ in range(2)]
    whole = sum(p.numel() for p in one.model.parameters())
    # Each worker holds half of every parameter (dim 0 split; odd sizes differ by a row).
    assert all(abs(local - whole / 2) < 0.01 * whole for local in sharded["locals"])
    # Started from the host (tests/test_fsdp_start_memory.py), a worker holds its share alone: fp32 shards (the
    # masters) and reference shards in the compute dtype, over 2 workers; 1% covers buffers and odd rows' padding.
    # No whole parameter outlives the start: on CUDA it would keep the whole model on the device.
    ref_bytes = torch.finfo(torch.float32 if precision == "fp32" else torch.bfloat16).bits // 8
    for start in sharded["starts"]:
        assert start["alive"] == 0
        assert start["held"] / start["params"] == pytest.approx((4 + ref_bytes) / 2, rel=0.01)
    # Buffers (rotary inv_freq) are no weights: under bf16 too they keep the fp32 values they were built with, in
    # the policy and in the reference (precision.cast_parameters).
    built = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_buffers())
    assert any("inv_freq" in name for name in built)
    for which in ("model", "ref"):
        for name, b in built.items():
            assert b.dtype == torch.float32 and torch.equal(sharded["buffers"][f"{which}.{name}"], b), name
    # The same numbers up to summation order (tests/tolerances.py). bf16 (fp32 shards, bf16 compute, fp32
    # reduction, as precision.MasterWeights): each worker's bf16 gradient is rounded before the sum, so Adam may
    # move a weight by up to its step bound, and metrics computed from bf16 activations may round one bf16 ulp
    # apart; the engine gets bf16 either way.
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    metric_rtol = rounding_rtol(dtype) if precision == "fp32" else eps(torch.bfloat16)
    for name, tensor in one.named_parameters_for_sync():
        assert sharded["weights"][name].dtype == tensor.dtype
        assert_adam_close(sharded["weights"][name], tensor, lr=SETTINGS["lr"], steps=2, dtype=dtype, what=name)
    for theirs, ours in zip(reference, sharded["metrics"]):
        for key in ("policy_loss", "grad_norm", "kl_ref", "logprob_abs_diff_mean", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=metric_rtol, abs=eps(dtype)), key
        assert ours["num_micro_batches"] == theirs["num_micro_batches"] == 3  # 1 on rank 0 (padded to 2) + 2
    # The sharded group's checkpoint is an ordinary one: an unsharded trainer resumes from it (weights and Adam
    # moments) and takes the step the reference takes.
    resumed = Trainer(str(tiny_model_dir), **SETTINGS, precision=precision)
    assert resumed.load_checkpoint(tmp_path / "fsdp2.pt.checkpoint") == {"step": 2}
    resumed.train_step(samples())
    one.train_step(samples())
    for (name, ours), (_, theirs) in zip(resumed.named_parameters_for_sync(), one.named_parameters_for_sync()):
        assert_adam_close(ours, theirs, lr=SETTINGS["lr"], steps=3, dtype=dtype, what=name)


def test_the_memory_estimate_divides_by_the_shards(tmp_path, tiny_model_dir):
    from astuner.config.compose import load_config
    from astuner.errors import UserError
    from astuner.preflight import ModelFacts, make_plan
    from test_run_contract import write_run

    yaml = write_run(tmp_path, tiny_model_dir)
    facts = ModelFacts("m", "LlamaForCausalLM", 1_000_000, 2048)

    def plan(backbone: str, *overrides: str):
        typed = load_config(yaml, ["astuner.trainer_common.n_gpus_per_node=4", "astuner.trainer_common.precision=fp32",
                                   "astuner.trainer_common.use_kl_loss=true", *overrides]).typed
        return make_plan(typed, backbone, facts, 256, 4)

    # fp32 AdamW: 16 bytes a parameter, the reference model 4; fsdp2 over 4 workers holds a quarter of each.
    whole = plan("verl", "astuner.trainer_common.strategy=ddp")
    assert (whole.trainer_bytes, whole.ref_bytes) == (16_000_000, 4_000_000)
    sharded = plan("verl", "astuner.trainer_common.strategy=fsdp2")
    assert (sharded.trainer_bytes, sharded.ref_bytes) == (4_000_000, 1_000_000)
    assert plan("debug", "astuner.trainer_common.strategy=fsdp2").trainer_bytes == 16_000_000  # one process
    with pytest.raises(UserError, match="strategy ddp"):
        plan("verl", "astuner.trainer_common.strategy=fsdp2", "astuner.trainer_common.lora.rank=8")
