"""`astuner doctor`: the verdicts (pure), a check that raises does not stop the others, the memory plan of a
config that does not fit fails with exit 1, and the whole checklist on CPU with vLLM and the demo model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

QUICKSTART = REPO / "tutorial" / "quickstart" / "quickstart.yaml"
GIB = 2**30


def test_shm_verdict():
    from astuner.doctor.base import SHM_DOCKER_DEFAULT
    from astuner.doctor.system import shm_verdict

    assert shm_verdict(free=100 * 2**20, needed=270 * 2**20)[0] == "fail"  # the demo model in bf16 in 100 MB
    status, todo = shm_verdict(free=SHM_DOCKER_DEFAULT, needed=0)
    assert status == "warn" and "--shm-size" in todo
    assert shm_verdict(free=512 * 2**20, needed=0)[0] == "warn"
    assert shm_verdict(free=16 * GIB, needed=GIB) == ("pass", "")


def test_parity_verdict_uses_the_dtype_limits():
    from astuner.doctor.model import parity_verdict

    assert parity_verdict(1e-5, 3e-5, "float32") == ("pass", "")
    # bf16 noise passes in bf16 but is a failure between fp32 sides
    assert parity_verdict(0.01, 0.2, "bfloat16")[0] == "pass"
    assert parity_verdict(0.01, 0.2, "float32")[0] == "fail"
    # the rounded-rotary signature: a mean past the bf16 limit
    status, todo = parity_verdict(0.03, 0.37, "bfloat16")
    assert status == "fail" and "rotary" in todo


def test_rounded_buffers_are_named():
    import torch

    from astuner.doctor.model import float_buffers_not_fp32

    model = torch.nn.Linear(2, 2)
    model.register_buffer("inv_freq", torch.ones(4, dtype=torch.bfloat16))
    model.register_buffer("positions", torch.arange(4))  # integer buffers keep their dtype
    assert float_buffers_not_fp32(model) == ["inv_freq"]


def test_a_check_that_raises_fails_and_the_rest_still_run(monkeypatch):
    from astuner import doctor

    def broken(ctx):
        raise RuntimeError("no driver\nat all")

    checks = dict(doctor.CHECKS)
    monkeypatch.setattr(doctor, "CHECKS", {"versions": checks.pop("versions"), "broken": broken, **checks})
    seen = []
    results = doctor.run_checks(doctor.Context(device="cpu", model="demo:smollm2-135m-instruct", quick=True),
                                seen.append)
    by_name = {r.name: r for r in results}
    assert by_name["broken"].status == "fail" and by_name["broken"].seen == "RuntimeError: no driver at all"
    assert by_name["devices"].status == "pass"  # after the failure
    assert [r.name for r in seen] == [r.name for r in results]
    assert by_name["trainer"].status == "skip"  # --quick
    assert "1 failed" in doctor.summary(results) and "not ready" in doctor.summary(results)


def test_memory_plan_that_does_not_fit_fails_with_exit_1(monkeypatch, tmp_path, capsys):
    from astuner import preflight
    from astuner.cli import main

    monkeypatch.setattr(preflight, "available_memory", lambda device: GIB)  # 1 GiB for a 135M GRPO run
    code = main(["doctor", "--quick", "--conf", str(QUICKSTART), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    plan = next(line for line in out.splitlines() if "memory plan" in line)
    assert plan.lstrip().startswith("FAIL")
    assert "ASTUNER_SKIP_MEMORY_CHECK" in out  # what to do
    results = json.loads((tmp_path / "doctor.json").read_text())
    assert {r["name"]: r["status"] for r in results}["memory plan"] == "fail"


def test_overrides_without_a_config_are_refused(capsys):
    from astuner.cli import main

    assert main(["doctor", "--quick", "astuner.rollout.top_k=5"]) == 2
    assert "need --conf" in capsys.readouterr().err


@pytest.mark.slow
def test_whole_checklist_on_cpu(tmp_path, tiny_model_dir):
    """The command as a user types it: every check passes or is skipped for a reason that holds on CPU. The model
    is the tiny one with the demo model's position limit (the 3000-token parity prompt needs it): every check runs
    its real engine and trainer, in a fraction of the demo model's time."""
    import shutil

    tiny = tmp_path / "tiny_8k"
    shutil.copytree(tiny_model_dir, tiny)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    proc = subprocess.run([sys.executable, "-m", "astuner.cli", "doctor", "--conf", str(QUICKSTART),
                           "--out", str(tmp_path / "out"), f"astuner.model.path={tiny}"], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = {r["name"]: r for r in json.loads((tmp_path / "out" / "doctor.json").read_text())}
    statuses = {name: r["status"] for name, r in results.items()}
    assert statuses == {"versions": statuses["versions"], "devices": "pass", "sleep mode": "skip",
                        "shared memory": "pass", "trainer": "pass", "engine start": "pass",
                        "long-sequence parity": "pass", "weight sync": "pass", "sleep, train, wake": "pass",
                        "memory plan": "pass"}, proc.stdout
    assert results["long-sequence parity"]["figures"]["prompt_tokens"] == 3000
    assert results["weight sync"]["figures"]["verified"] == 1.0
    assert "Loading weights" not in proc.stdout + proc.stderr  # library bars stay off the console
    assert "vLLM" not in proc.stderr.replace("vLLM engine", "")  # vLLM's own output went to doctor.log
    assert (tmp_path / "out" / "doctor.log").stat().st_size > 0


@pytest.mark.slow
def test_the_checklist_tries_the_configs_sampling_adapters_and_roster(tmp_path, tiny_model_dir, monkeypatch):
    """The config's own settings are what the checks run: two models as LoRA adapters on one base (one vLLM
    engine with multi-LoRA, sleeping at level 1), each trainer with the config's rank, each sampling with its own
    top_p and top_k (the keeper's set on its entry) and the trainer recomputing under the same filters, and the
    memory plan counting the second model."""
    from astuner.cli import main

    code = main(["doctor", "--conf", str(QUICKSTART), "--out", str(tmp_path), "--parity-tokens", "200",
                 f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=vllm",
                 "astuner.rollout.top_p=0.9", "astuner.rollout.top_k=20", "astuner.trainer_common.lora.rank=8",
                 f"+astuner.models.keeper.path={tiny_model_dir}", "+astuner.models.keeper.top_k=5"])
    results = {r["name"]: r for r in json.loads((tmp_path / "doctor.json").read_text())}
    assert code == 0, {name: (r["status"], r["seen"], r["todo"]) for name, r in results.items()}
    assert results["engine start"]["figures"]["engine"] == "vllm"
    assert results["engine start"]["figures"]["models"] == ["policy", "keeper"]
    assert "keeper as adapters on one base" in results["engine start"]["seen"].replace("policy, ", "")
    assert results["trainer"]["figures"]["models"] == {"policy": {"lora_rank": 8}, "keeper": {"lora_rank": 8}}
    for check in ("long-sequence parity", "sleep, train, wake"):
        per = results[check]["figures"]["models"]
        assert {name: (m["temperature"], m["top_p"], m["top_k"]) for name, m in per.items()} == {
            "policy": (0.7, 0.9, 20), "keeper": (0.7, 0.9, 5)}, check
    assert results["weight sync"]["figures"]["adapters"] == ["policy", "keeper"]
    assert results["sleep, train, wake"]["figures"]["sleep_levels"] == [1]  # the base weights survive the sleep
    assert "other models" in results["memory plan"]["seen"]
