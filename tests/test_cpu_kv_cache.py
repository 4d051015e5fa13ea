"""An engine started outside a run's memory fit (`astuner eval`, the warm start) sizes vLLM's CPU KV cache from
what vLLM checks it against, the NUMA node's available memory, instead of asking for max_num_seqs full-length
sequences that a 24 GiB machine does not have."""

from __future__ import annotations

import json

import pytest

from astuner.preflight import cpu_kv_cache_bytes
from astuner.memory import available_memory, node_available_memory

GIB = 2**30


def write_config(folder, weights_bytes=0):
    # 24 layers, 2 KV heads of 64: 24 * 2 (K and V) * 2 * 64 * 4 bytes = 24 KiB a token in fp32.
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 24, "vocab_size": 1000,
        "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"}))
    (folder / "model.safetensors").write_bytes(b"\0" * weights_bytes)
    return folder


def test_the_kv_cache_fits_in_what_the_weights_leave_of_the_node_by_hand(tmp_path):
    model = write_config(tmp_path / "m", weights_bytes=1000)
    per_token = 24 * 2 * 2 * 64 * 4
    per_seq = per_token * 8192  # 8192 tokens: 64 whole blocks of 128; 192 MiB a sequence
    # Plenty of memory: max_num_seqs = 64 full-length sequences want 12 GiB (rounded up to whole GiB).
    assert cpu_kv_cache_bytes(str(model), 8192, 64, "float32", available=100 * GIB) == 12 * GIB
    # 9.7 GiB available (a busy 24 GiB machine's node 0): half of what the weights (fp32: twice the bf16 file) leave.
    assert cpu_kv_cache_bytes(str(model), 8192, 64, "float32", available=int(9.7 * GIB)) == \
        (int(9.7 * GIB) - 2000) // 2
    # Less than one sequence's worth: one full-length sequence still (vLLM then says what does not fit).
    assert cpu_kv_cache_bytes(str(model), 8192, 64, "float32", available=GIB // 4) == per_seq
    # A short max_model_len: whole blocks, at least 1 GiB as before.
    assert cpu_kv_cache_bytes(str(model), 100, 4, "float32", available=100 * GIB) == GIB


def test_the_node_memory_is_what_vllm_reads():
    """Never more than vLLM's own figure (its check would refuse the cache), read a moment apart on a machine that
    is running tests."""
    from vllm.utils.cpu_resource_utils import get_cgroup_memory_limit, get_memory_node_info

    theirs = get_memory_node_info(0).available_memory
    assert available_memory("cpu") <= theirs + 256 * 2**20
    ours = node_available_memory()
    if ours is not None and get_cgroup_memory_limit() is None:  # vLLM clamps by a cgroup limit; the node alone here
        assert abs(ours - theirs) < 256 * 2**20


LOG = """\
2026-11-28 11:02:10.101 INFO vllm: Automatically detected platform cpu.
(EngineCore pid=4242) Traceback (most recent call last):
(EngineCore pid=4242) ValueError: Available memory on node 0 (9.7/13.0 GiB) on kv cache allocation is less than \
requested memory for kv (16.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory \
used by other processes.
(EngineCore pid=4242) RuntimeError: Worker failed with error 'Available memory on node 0 (9.7/13.0 GiB)', please \
check the stack trace above for the root cause
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_vllms_first_error_without_its_flag_names():
    from astuner.engine.start_failure import advice, root_cause

    cause = root_cause(LOG)
    assert cause == ("ValueError: Available memory on node 0 (9.7/13.0 GiB) on kv cache allocation is less than "
                     "requested memory for kv (16.0 GiB).")
    fix = advice(cause, on_cuda=False, max_model_len=8192, max_num_seqs=64, gpu_memory_utilization=0.6)
    assert "astuner.rollout.max_model_len lower (now 8192" in fix and "astuner.rollout.max_num_seqs (now 64)" in fix
    assert "--" not in cause + fix
    assert root_cause("RuntimeError: Engine core initialization failed. See root cause above.") is None


@pytest.mark.slow
def test_an_engine_that_cannot_start_is_one_error_paragraph_with_the_keys_that_fix_it(tmp_path, tiny_model_dir,
                                                                                        monkeypatch, capsys):
    """Real vLLM, asked for a KV cache no machine has: `astuner eval` exits 1 with vLLM's root cause and the astuner
    keys, no traceback."""
    from test_run_contract import write_run

    from astuner.cli import main

    yaml = write_run(tmp_path, tiny_model_dir)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")  # GiB
    code = main(["eval", "--conf", str(yaml), "--num-repeat", "0", "astuner.rollout.engine=vllm"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err[-3000:]
    error = next(line for line in err.splitlines() if line.startswith("astuner: error:"))
    assert "did not start: ValueError: Available memory on node" in error
    assert "astuner.rollout.max_model_len lower (now 256" in error and "eval.log" in error
