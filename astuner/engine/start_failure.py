"""Why a vLLM engine did not start, in one paragraph: vLLM's root-cause line (read from its processes' output in
the run's log) and the astuner keys that fix it, instead of a traceback whose cause is only in the log, with advice
in vLLM's flag names."""

from __future__ import annotations

import re
from pathlib import Path

# The last line of a traceback: "ValueError: Available memory on node 0 (...) is less than ...".
_ROOT = re.compile(r"((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)): (.+)$")


_WRAPPERS = ("Engine core initialization failed", "Worker failed with error", "did not start")


def root_cause(log_text: str) -> str | None:
    """The first exception line of `log_text` that is not a wrapper of another (the engine core's root error, raised
    before the errors that carry it out), without vLLM's advice in its own flag names; None when there is none."""
    for line in log_text.splitlines():
        match = _ROOT.search(line)
        if match and not any(w in match.group(2) for w in _WRAPPERS):
            sentences = re.split(r"(?<=\.) ", match.group(2).strip())
            kept = [x for x in sentences if "--" not in x and not x.startswith(("To resolve", "Reduce", "Decrease"))]
            return f"{match.group(1).rsplit('.', 1)[-1]}: {' '.join(kept or sentences[:1])}"
    return None


def advice(cause: str, on_cuda: bool, max_model_len: int, max_num_seqs: int, gpu_memory_utilization: float) -> str:
    """The astuner keys that address `cause`."""
    text = cause.lower()
    if not on_cuda and ("memory" in text or "kv cache" in text):
        return ("On CPU the KV cache holds max_num_seqs sequences of max_model_len tokens: set "
                f"astuner.rollout.max_model_len lower (now {max_model_len}; an episode's whole context) or "
                f"astuner.rollout.max_num_seqs (now {max_num_seqs}), or free memory; VLLM_CPU_KVCACHE_SPACE=<GiB> "
                "sets the cache outright.")
    if "out of memory" in text or "gpu_memory_utilization" in text or "kv cache" in text or "memory" in text:
        return (f"Set astuner.rollout.gpu_memory_utilization (now {gpu_memory_utilization}; the card's share for "
                f"weights and KV cache) or lower astuner.rollout.max_model_len (now {max_model_len}) or "
                f"astuner.rollout.max_num_seqs (now {max_num_seqs}); `astuner doctor --conf x.yaml` shows the plan.")
    if "max_model_len" in text or "max_position_embeddings" in text or "model length" in text:
        return (f"Set astuner.rollout.max_model_len (now {max_model_len}) within what the model supports.")
    return "The log above the line holds vLLM's full output."


def log_since(path: Path | None, offset: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def log_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def explain(exc: Exception, model_path: str, log_path: Path | None, log_start: int, settings: dict,
            on_cuda: bool) -> None:
    """Raise what a failed engine start says: EngineStartError with vLLM's root cause (from the log written since
    `log_start`) and the keys that fix it; else a RuntimeError naming the log; returns when there is no log."""
    from astuner.errors import EngineStartError

    cause = root_cause(log_since(log_path, log_start))
    if cause is not None:
        fix = advice(cause, on_cuda, settings["max_model_len"], settings["max_num_seqs"],
                     settings["gpu_memory_utilization"])
        raise EngineStartError(f"the vLLM engine for {model_path} did not start: {cause} {fix} (vLLM's output: "
                               f"{log_path})") from exc
    if log_path is not None:
        raise RuntimeError(f"the vLLM engine did not start ({type(exc).__name__}: {exc}); its processes' output is "
                           f"in {log_path}") from exc
