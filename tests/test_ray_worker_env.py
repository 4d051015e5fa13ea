"""The environment the Ray backbones hand their actors: a joined cluster's workers do not inherit the driver's,
so the NCCL, vLLM, CUDA and allocator settings a user exported must travel with each actor."""

from __future__ import annotations

import pytest

from astuner.backbone.ray_cluster import worker_env

EXPORTED = {
    "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO",
    "VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "VLLM_CPU_KVCACHE_SPACE": "8",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_LAUNCH_BLOCKING": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    "NVIDIA_TF32_OVERRIDE": "0",
    "HF_HUB_OFFLINE": "1", "ASTUNER_CACHE": "/data/cache",
}
NODE_OR_RAY_OWNED = {
    "CUDA_VISIBLE_DEVICES": "0,1",  # Ray sets each actor's own
    "NVIDIA_VISIBLE_DEVICES": "all",
    "VLLM_HOST_IP": "10.0.0.1",  # the driver's node
    "CUDA_HOME": "/usr/local/cuda-12.8", "CUDA_VERSION": "12.8.1",  # the driver node's CUDA install
    "NVIDIA_REQUIRE_CUDA": "cuda>=12.8",
    "RAY_ADDRESS": "10.0.0.1:6379", "HOME": "/root", "PATH": "/usr/bin", "NCCLX": "not a prefix match",
}


def test_nccl_vllm_cuda_and_allocator_settings_reach_the_actors(monkeypatch):
    for key, value in {**EXPORTED, **NODE_OR_RAY_OWNED}.items():
        monkeypatch.setenv(key, value)
    env = worker_env()
    assert {k: env.get(k) for k in EXPORTED} == EXPORTED
    assert not set(env) & set(NODE_OR_RAY_OWNED), sorted(set(env) & set(NODE_OR_RAY_OWNED))


def test_an_explicit_environment_is_read_instead_of_this_process():
    assert worker_env({"NCCL_P2P_DISABLE": "1", "HOME": "/x"}) == {"NCCL_P2P_DISABLE": "1"}


def test_a_cluster_that_keeps_every_gpu_visible_is_refused():
    from astuner.backbone.ray_worker import NOSET_VISIBLE, check_gpu_isolation
    from astuner.errors import UserError

    check_gpu_isolation({})
    check_gpu_isolation({NOSET_VISIBLE: "0"})
    with pytest.raises(UserError, match=f"unset {NOSET_VISIBLE}"):
        check_gpu_isolation({NOSET_VISIBLE: "1"})
