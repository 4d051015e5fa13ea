"""Ray for the verl and trinity backbones: joining or starting a cluster, checking that it can hold the
placement before asking for it, and waiting on actors with a deadline that names who waited for whom.

Ray is imported here and in the backbone modules only (never by the config or the CLI's help).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from astuner.errors import UserError, WorkerLost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bundle:
    """What one actor needs: CPUs, GPUs, and bytes of host memory (for the check only)."""

    name: str
    cpus: float
    gpus: float = 0.0
    memory: float = 0.0


def _unreachable(address: str, why: str = "") -> UserError:
    return UserError(
        f"RAY_ADDRESS={address}: nothing answers there{why}. Start the cluster with `ray start --head` on the head "
        "node (it prints the address to use), or unset RAY_ADDRESS to run on a local cluster started for this run.")


def connect(start_local: bool = True) -> bool:
    """Join the cluster at RAY_ADDRESS, else the one `ray start --head` started on this machine; when there is
    none, start a private local cluster if `start_local` (the CLI's --with-ray), else stop with what to do. Returns
    True when this process started it (it stops with `ray.shutdown()`)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 writes an auth token otherwise
    import ray

    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, logging_level=logging.WARNING)
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "auto" and not _answers(address):
        raise _unreachable(address)  # Ray itself retries an unreachable address for minutes before it gives up
    # Not Ray's own address="auto" when RAY_ADDRESS is unset: with no `ray start` record it joins any Ray cluster it
    # finds among the machine's processes, such as another run's private one, whose end takes this run's actors.
    recorded = None if address else _recorded_cluster()
    if address or recorded:
        try:
            ray.init(address=address or recorded, **quiet)
        except ConnectionError as exc:
            if address:
                raise _unreachable(address, f" as a Ray cluster ({exc})") from None
            raise UserError(f"the Ray cluster `ray start` recorded at {recorded} answers but not as a Ray cluster "
                            f"({exc}): run `ray stop` and start it again, or set RAY_ADDRESS.") from None
        log.info("joined the Ray cluster at %s", address or f"{recorded} (recorded by `ray start` on this machine)")
        return False
    if not start_local:
        raise UserError(
            "no Ray cluster to join: RAY_ADDRESS is unset and `ray start` runs no cluster on this machine. Add "
            "--with-ray (tune(): with_ray=True) to start a local cluster for this run, or start one with `ray start "
            "--head` (and `ray start --address=<head>:6379` on each other node).")
    ray.init(address="local", **quiet)
    log.info("started a local Ray cluster for this run (%s CPUs, %s GPUs); it stops when the run ends",
             ray.cluster_resources().get("CPU", 0), ray.cluster_resources().get("GPU", 0))
    return True


def _recorded_cluster() -> str | None:
    """The address `ray start` recorded in Ray's temp folder (RAY_TMPDIR/ray, else /tmp/ray), when something
    answers there; None when there is no record, or only a stale one (its cluster was stopped without `ray stop`)."""
    from ray._private.utils import read_ray_address  # the file `ray start` writes and `ray.init()` reads

    address = read_ray_address()
    if not address:
        return None
    if not _answers(address):
        log.warning("the Ray cluster `ray start` recorded at %s does not answer (stopped without `ray stop`?): "
                    "taking it as none", address)
        return None
    return address


def _answers(address: str, timeout_s: float = 5.0) -> bool:
    """A TCP connection to host:port opens within `timeout_s` (Ray client addresses, ray://, are left to Ray)."""
    import socket

    if "://" in address:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def check_resources(bundles: list[Bundle], what_for: str) -> None:
    """Exit 2 (UserError) naming what is missing when the cluster cannot hold `bundles` at all: in total, or
    one bundle on any single node. Ray would otherwise wait forever for the placement."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    missing = missing_resources(bundles, nodes)
    if missing:
        layout = ", ".join(f"{b.name}: {b.cpus:g} CPU {b.gpus:g} GPU" for b in bundles)
        raise UserError(
            f"{what_for} needs {'; '.join(missing)}. Placement asked for: {layout}. Add nodes (ray start "
            "--address=<head>:6379 on each), or lower astuner.trainer_common.n_gpus_per_node / nnodes / "
            "cpus_per_worker / n_explorers or astuner.rollout.tensor_model_parallel_size (each "
            "engine takes that many GPUs)."
        )


def missing_resources(bundles: list[Bundle], nodes: list[dict]) -> list[str]:
    """What the alive `nodes` (Ray's per-node resource dicts) lack to hold `bundles`, in words; [] when they fit."""
    total = {k: sum(n.get(k, 0.0) for n in nodes) for k in ("CPU", "GPU", "memory")}
    need = {"CPU": sum(b.cpus for b in bundles), "GPU": sum(b.gpus for b in bundles),
            "memory": sum(b.memory for b in bundles)}
    missing = []
    for k, unit in (("CPU", ""), ("GPU", ""), ("memory", " GiB")):
        scale = 2**30 if k == "memory" else 1
        if need[k] > total[k] + 1e-9:  # memory: the preflight estimate against what Ray offers to its workers
            missing.append(f"{need[k] / scale:.3g}{unit} {k} (the cluster has {total[k] / scale:.3g}{unit})")
    if need["memory"] > total["memory"]:
        missing[-1] += " (lower the model size, or add trainer_common.lora, or add nodes)"
    for b in bundles:
        if not any(n.get("CPU", 0) >= b.cpus and n.get("GPU", 0) >= b.gpus for n in nodes):
            missing.append(f"one node with {b.cpus:g} CPU and {b.gpus:g} GPU for {b.name}")
            break
    return missing


def place(bundles: list[Bundle], timeout_s: float, what_for: str):
    """A placement group holding `bundles` (PACK: as few nodes as possible), ready within `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_resources(bundles, what_for)
    free = ray.available_resources()
    if sum(b.cpus for b in bundles) > free.get("CPU", 0) + 1e-9 or sum(b.gpus for b in bundles) > free.get("GPU", 0):
        log.warning("%s: the cluster's free CPUs/GPUs (%s) do not hold the placement now; waiting up to %g s for "
                    "other jobs to release them (`ray status` shows who holds them)", what_for,
                    {k: free.get(k, 0) for k in ("CPU", "GPU")}, timeout_s)
    spec = [{"CPU": b.cpus, **({"GPU": b.gpus} if b.gpus else {})} for b in bundles]
    group = placement_group(spec, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise UserError(
            f"{what_for}: the cluster has the resources in total, but they were not free within {timeout_s:g} s "
            f"(astuner.trainer_common.actor_timeout_s); other jobs hold them. `ray status` shows who."
        )
    return group


def get(refs, timeout_s: float, waiter: str, who: list[str], what: str, trainer_ok: bool):
    """ray.get with a deadline: a dead actor or an expired wait becomes WorkerLost naming both sides."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    single = not isinstance(refs, list)
    refs_list = [refs] if single else refs
    try:
        out = ray.get(refs_list, timeout=timeout_s)
    except GetTimeoutError:
        raise WorkerLost(f"{waiter} waited {timeout_s:g} s for {', '.join(who)} to {what}, in vain "
                         "(astuner.trainer_common.actor_timeout_s); the actor is stuck or far too slow",
                         trainer_ok) from None
    except RayActorError as exc:
        raise WorkerLost(f"{waiter} lost {_name_of(who)} while waiting for it to {what}: the "
                         f"actor died. {_cause(exc)}", trainer_ok) from None
    except RayTaskError as exc:
        raise WorkerLost(f"{_name_of(who)} failed to {what}: {_cause(exc)}", trainer_ok) from None
    return out[0] if single else out


def _name_of(who: list[str]) -> str:
    return who[0] if len(who) == 1 else "one of " + ", ".join(who)


def _cause(exc) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-12:])


FORWARDED_KEYS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "ASTUNER_CACHE", "PYTHONPATH",
                  "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ASTUNER_FINGERPRINT_THREADS")
# The settings of NCCL, vLLM, CUDA and NVIDIA's libraries a user exports before a run (NCCL_SOCKET_IFNAME,
# NCCL_IB_HCA, VLLM_ATTENTION_BACKEND, CUDA_DEVICE_MAX_CONNECTIONS, NVIDIA_TF32_OVERRIDE, ...).
FORWARDED_PREFIXES = ("NCCL_", "VLLM_", "CUDA_", "NVIDIA_")
# Which devices an actor sees is Ray's to set (each actor its bundle's GPUs); an address, a CUDA install's paths
# and version name this node only: the driver's values would put every actor on the driver's GPUs, point it at
# the driver's host, or send JIT compilers to a CUDA install its node may not have.
NOT_FORWARDED = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "VLLM_HOST_IP", "CUDA_HOME", "CUDA_PATH",
                           "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA", "NVIDIA_DRIVER_CAPABILITIES", "CUDA_ROOT"})


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for actors, from `environ` (default: this process's): a joined cluster's workers do not
    inherit the driver's, so what a user exported for the run (FORWARDED_KEYS, and every variable under
    FORWARDED_PREFIXES but NOT_FORWARDED) is handed to each actor."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k not in NOT_FORWARDED and (k in FORWARDED_KEYS or k.startswith(FORWARDED_PREFIXES))}
