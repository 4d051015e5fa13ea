#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (CPU only, no network but the package index).
# With no arguments, the numerical tests then run a second time on torch's AVX2 kernels: other kernels sum in
# another order, as another CPU would (tolerances come from the dtype: tests/tolerances.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
. .venv/bin/activate
python -m pytest -q "$@"
if [ $# -eq 0 ]; then
  echo "numerical tests on torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2):"
  ATEN_CPU_CAPABILITY=avx2 python -m pytest -q tests/test_trainer.py tests/test_fsdp.py tests/test_loss.py \
    tests/test_merge.py tests/test_precision.py tests/test_lora.py tests/test_hf_engine.py tests/test_vllm_engine.py \
    tests/test_sampling_filters.py tests/test_advantage.py tests/test_chunked_head_filters.py \
    tests/test_precision_buffers.py \
    -k "not sigterm and not debug_backbone_two_steps and not later_engine"  # vLLM's process handling: no arithmetic
  echo "AgentScope 2.x, in its own environment (.venv-as2):"
  .venv-as2/bin/python -m pytest -q tests/test_agentscope2.py
fi
