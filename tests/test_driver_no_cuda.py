"""A Ray driver never starts CUDA in its own process: it would hold a context on the head's GPU 0 for the whole run,
and a CPU-only head would plan the GPU workers' run for CPU. The plan's device comes from the cluster's resources
and its memory from a GPU worker (`backbone/ray_run.cluster_device`); here the cluster is a resource dict and the
worker a function, and every torch.cuda query the driver could make raises."""

from __future__ import annotations

import pytest
import torch
from test_run_contract import write_run

from astuner.backbone.ray_run import cluster_device
from astuner.config import load_config
from astuner.preflight import GIB

GPU_NODE = {"CPU": 64.0, "GPU": 8.0, "memory": 512.0 * GIB}


def _cuda_forbidden(monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("the driver called torch.cuda")

    for name in ("is_available", "mem_get_info", "device_count", "init", "_lazy_init", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, touched)


def _prepare(tmp_path, tiny_model_dir, backbone, device_of, *overrides):
    from astuner import runtime

    loaded = load_config(write_run(tmp_path, tiny_model_dir), ["astuner.trainer_common.n_gpus_per_node=2",
                                                               *overrides])
    return runtime.prepare(loaded, backbone, device_of=device_of).plan


def test_a_ray_driver_plans_for_the_clusters_gpus_without_touching_cuda(tmp_path, tiny_model_dir, monkeypatch):
    _cuda_forbidden(monkeypatch)
    asked = []

    def gpu_worker(gpus, timeout_s):
        asked.append((gpus, timeout_s))
        return 70 * GIB, 80 * GIB

    plan = _prepare(tmp_path, tiny_model_dir, "verl", lambda: cluster_device(GPU_NODE, 30.0, gpu_worker),
                    "astuner.rollout.engine=vllm", "astuner.rollout.gpu_memory_utilization=0.5")
    assert asked == [(1.0, 30.0)]  # one GPU, as each trainer worker holds, within the deadline
    assert plan.device == "cuda" and plan.available_bytes == 70 * GIB
    assert plan.engine_bytes == 40 * GIB  # vLLM's share of the worker's card, not of a card the driver has


def test_a_cpu_only_cluster_plans_for_cpu_whatever_the_driver_has(tmp_path, tiny_model_dir, monkeypatch):
    _cuda_forbidden(monkeypatch)

    def no_worker(gpus, timeout_s):
        raise AssertionError("no GPU to ask")

    plan = _prepare(tmp_path, tiny_model_dir, "trinity", lambda: cluster_device({"CPU": 8.0}, 30.0, no_worker))
    assert plan.device == "cpu" and plan.engine == "hf"


@pytest.mark.slow
def test_the_gpu_worker_probe_runs_in_a_ray_task_and_says_what_to_do_without_cuda():
    """A local cluster that claims a GPU on this CPU-only machine: the probe is scheduled on it (a GPU task) and
    its worker, which has no CUDA, stops the run with what to check. In a process of its own: a Ray session of
    another test in this one must neither be reused nor stopped."""
    import os
    import subprocess
    import sys

    script = """
import os, sys
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as ray_cluster.connect does
import ray
from astuner.backbone.ray_run import cluster_device
from astuner.errors import WorkerLost
ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False)
try:
    cluster_device(ray.cluster_resources(), 60.0)
except WorkerLost as exc:
    print("WorkerLost:", exc)
finally:
    ray.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WorkerLost:" in proc.stdout and "torch.cuda.is_available" in proc.stdout, proc.stdout[-3000:]
