"""An fsdp2 start puts only each worker's share on its device (astuner/trainer/core.py: Trainer.shard_on_join).

Built knowing its group (settings strategy and group_size, as trainer/build.py's build_trainer builds a Ray worker), the
trainer keeps the whole fp32 model on the host; join_group shards it, and fully_shard moves each unit to the device
and keeps its shard. Built not knowing, it put the whole fp32 model and its fp32 masters on every GPU first (8
bytes a parameter with bf16 and a reference model, 10 at the peak). On CPU the host is the device, so the tests
stand in for the accelerator: here a trainer built for CUDA must touch no CUDA tensor before sharding (torch's CPU
build raises at the first one); in tests/test_fsdp.py the gloo workers started from the host hold their share
alone (bytes per parameter) and no whole parameter outlives the start."""

from __future__ import annotations

import pytest
import torch

from astuner.trainer import Trainer
from astuner.types import Sample


def test_a_trainer_built_to_shard_keeps_its_model_on_the_host(tiny_model_dir):
    t = Trainer(str(tiny_model_dir), device="cuda", strategy="fsdp2", group_size=2, use_kl_loss=True)
    assert t.shard_on_join and t.precision == "bf16"  # auto precision on CUDA
    tensors = [*t.model.parameters(), *t.model.buffers(), *t.ref_model.parameters(), *t.ref_model.buffers()]
    assert all(x.device.type == "cpu" for x in tensors)
    # One fp32 copy (the shards will be the masters) and the reference in the compute dtype: no bf16 copy beside
    # fp32 masters, and no optimizer before the shards exist.
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in t.ref_model.parameters())
    assert t.optimizer is None
    with pytest.raises(RuntimeError, match="join_group"):
        t.forward_logprobs([Sample([1, 2], [3], [0.0], 0.0, 1.0, "a")])
    with pytest.raises(RuntimeError, match="join_group"):
        t.state_dict()


def test_a_trainer_built_to_shard_joins_only_a_sharded_group(tiny_model_dir):
    from astuner.trainer.data_parallel import DataParallel

    t = Trainer(str(tiny_model_dir), device="cpu", strategy="fsdp2", group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        t.join_group(DataParallel(0, 2), "ddp")  # checked before any collective
