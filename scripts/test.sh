#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (CPU only, no network but the package index), on two pytest-xdist
# workers (ASTUNER_TEST_WORKERS=N for another count, 0 for one process): much of the suite waits on processes it
# started (CLI runs, Ray, vLLM), so two workers on two cores finish well before one.
# With no arguments, the numerical tests then run a second time on torch's AVX2 kernels: other kernels sum in
# another order, as another CPU would (tolerances come from the dtype: tests/tolerances.py); beside that pass, the
# tests of AgentScope 2.x and verifiers, each in its own environment (scripts/test_apart.sh).
#   --fast      the edit loop's tier: every test not marked slow (-m "not slow"), a couple of minutes
#   ARGS...     pytest's own arguments (a file, -k ...), in one process
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
. .venv/bin/activate
workers=(-n "${ASTUNER_TEST_WORKERS:-2}")
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest -q "${workers[@]}" -m "not slow" "$@"
fi
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# loadfile: a module's tests share one worker, so a module's Ray cluster or engine is started once.
python -m pytest -q "${workers[@]}" --dist loadfile --durations=10
# The closing passes (AgentScope 2.x and verifiers, one process each) run beside the AVX2 pass: its wall is its
# vLLM module's worker, and verifiers' pass ends in a third of AgentScope's, so alone each left a core idle.
apart_log=$(mktemp)
bash scripts/test_apart.sh > "$apart_log" 2>&1 &
apart=$!
trap 'kill $apart 2>/dev/null || true; rm -f "$apart_log"' EXIT
echo "numerical tests on torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2):"
avx2_rc=0
ATEN_CPU_CAPABILITY=avx2 python -m pytest -q "${workers[@]}" --dist loadfile tests/test_trainer.py tests/test_fsdp.py \
  tests/test_loss.py tests/test_merge.py tests/test_precision.py tests/test_lora.py tests/test_hf_engine.py \
  tests/test_vllm_engine.py tests/test_sampling_filters.py tests/test_advantage.py tests/test_chunked_head_filters.py \
  tests/test_precision_buffers.py tests/test_depth_mismatch.py \
  -k "not sigterm and not debug_backbone_two_steps and not later_engine" || avx2_rc=$?  # vLLM's process handling
apart_rc=0
wait "$apart" || apart_rc=$?
echo "AgentScope 2.x (.venv-as2) and verifiers (.venv-vf), each in its own environment, beside the AVX2 pass:"
cat "$apart_log"
[ "$avx2_rc" = 0 ] && [ "$apart_rc" = 0 ]
