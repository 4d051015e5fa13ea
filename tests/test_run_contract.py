"""What a whole run promises, on a tiny random model with the real tokenizer:
every config key is read (or named as inactive), a killed run resumes exactly, bad input exits 2 before any
model loads, and a workflow's loguru lines land in the run's log file."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astuner.cli import main
from astuner.config import load_config, valid_keys
from astuner.config.applicability import key_is_inactive
from astuner.config.schema import Section, old_names

REPO = Path(__file__).resolve().parents[1]

WORKFLOW = '''
from loguru import logger
from astuner import Workflow, WorkflowOutput

class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        logger.info("workflow saw task {}", workflow_task.task.task_id)
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
'''
JUDGE = '''
from astuner.task_judge.base_judge import BaseJudge

class LengthJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        n = len(workflow_output.metadata["final_answer"])
        return n / 100.0, n > 80
'''
ROWS = [{"question": f"Say something about {w}.", "answer": w} for w in ["cats", "rain", "maps", "tea", "sun", "sea"]]


def write_run(folder: Path, model_dir: Path, astuner_extra: str = "", trainer_extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wf.py").write_text(WORKFLOW)
    (folder / "judge.py").write_text(JUDGE)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    yaml = folder / "tiny.yaml"
    yaml.write_text(f"""
astuner:
  project_name: tiny
  experiment_dir: {folder / "out"}
  model: {{path: {model_dir}}}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file: {{training: {{file_path: train.jsonl}}, validation: {{file_path: val.jsonl}}}}
  data: {{train_batch_size: 2, max_response_length: 64}}
  rollout: {{engine: hf, agentscope_workflow: wf.py->EchoWorkflow, num_repeat: 3, max_env_worker: 1,
            max_response_length_in_one_turn: 12, max_model_len: 256, compute_madness_checklist: []}}
  task_judge: {{judge_protocol: judge.py->LengthJudge}}
  trainer_common: {{total_training_steps: 4, total_epochs: 2, test_freq: 99999, save_freq: 2, val_before_train: false,
                   optim: {{lr: 1.0e-3}} {trainer_extra}}}
  {astuner_extra}
trinity: {{trainer: {{max_token_len_per_gpu: 512}}}}
""")
    return yaml


# --- every key is read ----------------------------------------------------------------------------------------


class Recorder:
    """Wraps the typed config; records the dotted path of every leaf read."""

    def __init__(self, obj, path: str, reads: set[str]) -> None:
        self._obj, self._path, self._reads = obj, path, reads

    def __getattr__(self, name: str):
        value = getattr(self._obj, name)
        path = f"{self._path}.{name}" if self._path else name
        if isinstance(value, Section):
            return Recorder(value, path, self._reads)
        self._reads.add(path)
        return value


# Read by load_config itself (it decides the output folder; checked by test_config's experiment_dir tests; it
# moves an old name's value to the key it now names, checked by test_config's old-name tests), and by the CLI for
# --with-logview (checked by test_logview).
READ_WHILE_LOADING = {"astuner.experiment_dir", "astuner.logview.port"} | set(old_names())


def keys_read_by_a_run(yaml: Path, overrides=()) -> tuple[set[str], set[str]]:
    """(keys read while running 1 step through the CLI's own steps, keys inactive under this config)."""
    from astuner.backbone import run_backbone
    from astuner.config import config_warnings
    from astuner.resume import plan_start

    loaded = load_config(yaml, list(overrides))
    reads: set[str] = set()
    recorded = dataclasses.replace(loaded, typed=Recorder(loaded.typed, "", reads))
    config_warnings(recorded, "debug")
    start = plan_start(recorded)
    run_backbone("debug", start.loaded, checkpoint=start.checkpoint)
    leaves = leaf_keys()
    inactive = {k for k in leaves if key_is_inactive(k, loaded.typed, "debug")}
    return reads, inactive


def leaf_keys() -> set[str]:
    from astuner.config.validate import default_at

    return {k for k in valid_keys() if not isinstance(default_at(k)[1], dict)}


@pytest.mark.slow
def test_every_config_key_is_read_or_named_inactive(tmp_path, tiny_model_dir, env_server):
    leaves = leaf_keys()
    one_step = ["astuner.trainer_common.total_training_steps=1"]
    # Run A: jsonl reader, KL off, constant LR, std normalisation on.
    reads_a, inactive_a = keys_read_by_a_run(write_run(tmp_path / "a", tiny_model_dir), one_step)
    assert leaves - reads_a - inactive_a - READ_WHILE_LOADING == set()
    # Run B flips every condition: huggingface reader (a local folder), KL on, cosine LR, no std normalisation,
    # dynamic sampling, GSPO, trainer-recomputed old logprobs with truncated IS.
    folder = tmp_path / "b"
    yaml = write_run(folder, tiny_model_dir)
    (folder / "ds").mkdir()
    (folder / "ds" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    reads_b, inactive_b = keys_read_by_a_run(yaml, one_step + [
        "astuner.task_reader.type=huggingface_dat_repo",
        f"astuner.task_reader.huggingface_dat_repo.dataset_path={folder / 'ds'}",
        "astuner.trainer_common.use_kl_loss=true",
        "astuner.trainer_common.optim.lr_scheduler_type=cosine",
        "astuner.trainer_common.algorithm.norm_adv_by_std_in_grpo=false",
        "astuner.trainer_common.algorithm.filter_groups.enable=true",
        "astuner.trainer_common.algorithm.filter_groups.max_num_gen_batches=2",
        "astuner.trainer_common.policy_loss.loss_mode=gspo",
        "astuner.trainer_common.old_logprobs=trainer",
        "astuner.trainer_common.rollout_is_cap=2.0",
        "astuner.trainer_common.lora.rank=4",
    ])
    assert leaves - reads_b - inactive_b - READ_WHILE_LOADING == set()
    # Run C: the environment-service reader and judge (the tutorial's service), merged samples.
    workflow = REPO / "tutorial" / "env_service" / "workflow.py"
    reads_c, inactive_c = keys_read_by_a_run(write_run(tmp_path / "c", tiny_model_dir), one_step + [
        "astuner.task_reader.type=env_service",
        f"astuner.task_reader.env_service.env_url={env_server[0]}",
        "astuner.task_reader.env_service.validation_split=test",
        f"astuner.rollout.agentscope_workflow='{workflow}->EnvServiceWorkflow'",
        "astuner.task_judge.judge_protocol='astuner.task_judge.env_service_judge->EnvServiceJudge'",
        "astuner.rollout.multi_turn.sample_mode=merge",
        "astuner.trainer_common.algorithm.type=rft",
        "astuner.trainer_common.algorithm.rft_reward_threshold=0.0",
    ])
    assert leaves - reads_c - inactive_c - READ_WHILE_LOADING == set()
    assert not env_server[1].instances  # the judge released every instance
    # Together they read every key but the vLLM engine's (these runs use the hf engine: an engine process per run
    # would double this test's time; tests/test_vllm_engine.py runs the loop on vLLM) and the trinity backbone's.
    # The Ray backbones' keys are read in tests/test_ray_backbones.py (trainer_groups, with several models, in
    # tests/test_ray_several_models.py).
    later = {k for k in leaves if k.startswith(("astuner.rollout.tensor_model_parallel_size",
                                                "astuner.rollout.max_num_seqs", "astuner.rollout.gpu_memory",
                                                "astuner.trainer_common.n_explorers", "astuner.trainer_common.nnodes",
                                                "astuner.trainer_common.n_gpus_per_node",
                                                "astuner.trainer_common.cpus_per_worker",
                                                "astuner.trainer_common.actor_timeout_s",
                                                "astuner.trainer_common.trainer_groups", "trinity.synchronizer"))}
    # Run D: DPO on offline pairs (no rollouts).
    folder = tmp_path / "d"
    yaml = write_run(folder, tiny_model_dir)
    pair = {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "assistant", "content": "Go away."}]}
    for name in ("pairs.jsonl", "val_pairs.jsonl"):
        (folder / name).write_text(json.dumps(pair) + "\n")
    reads_d, inactive_d = keys_read_by_a_run(yaml, one_step + [
        "astuner.trainer_common.algorithm.type=dpo", "astuner.offline_data.train_file=pairs.jsonl",
        "astuner.offline_data.val_file=val_pairs.jsonl"])
    assert {"astuner.trainer_common.algorithm.beta", "astuner.offline_data.train_file"} <= reads_d
    # Run E: reasoning-gym's generators and scorer, with the workflow and judge the environment brings.
    reads_e, inactive_e = keys_read_by_a_run(write_run(tmp_path / "e", tiny_model_dir), one_step + [
        "astuner.task_reader.type=reasoning_gym",
        "astuner.task_reader.reasoning_gym.datasets=[{name: chain_sum, config: {max_digits: 1}}]",
        "astuner.task_reader.reasoning_gym.size=4", "astuner.task_reader.reasoning_gym.validation_size=2",
        "astuner.rollout.agentscope_workflow=null",  # the judge at its default: the environment's own
        "astuner.task_judge.judge_protocol='astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge'",
    ])
    assert leaves - reads_e - inactive_e - READ_WHILE_LOADING == set()
    # Run F: on-policy distillation from a model-folder teacher, its reward weighed in. A server teacher's keys
    # are read in tests/test_distillation.py (an OpenAI-compatible server and `astuner serve`).
    reads_f, inactive_f = keys_read_by_a_run(write_run(tmp_path / "f", tiny_model_dir), one_step + [
        "astuner.trainer_common.algorithm.type=on_policy_distillation",
        f"astuner.teacher.model={tiny_model_dir}", "astuner.teacher.engine=hf",
        "astuner.trainer_common.algorithm.distill_reward_weight=0.5",
    ])
    assert leaves - reads_f - inactive_f - READ_WHILE_LOADING == set()
    # Run G: a TextArena game with the workflow and judge the environment brings, one model move a game.
    reads_g, inactive_g = keys_read_by_a_run(write_run(tmp_path / "g", tiny_model_dir), one_step + [
        "astuner.task_reader.type=textarena", "astuner.task_reader.textarena.size=2",
        "astuner.task_reader.textarena.validation_size=1", "astuner.task_reader.textarena.max_turns=1",
        "astuner.rollout.agentscope_workflow=null",
        "astuner.task_judge.judge_protocol='astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge'",
    ])
    assert leaves - reads_g - inactive_g - READ_WHILE_LOADING == set()
    # Run H: an OpenEnv environment (the tutorial's package, served here) with its own workflow and judge.
    reads_h, inactive_h = keys_read_by_a_run(write_run(tmp_path / "h", tiny_model_dir), one_step + [
        "astuner.task_reader.type=openenv", f"astuner.task_reader.openenv.app_dir={REPO / 'tutorial/openenv/calc_env'}",
        "astuner.task_reader.openenv.size=2", "astuner.task_reader.openenv.validation_size=1",
        "astuner.task_reader.openenv.max_turns=1", "astuner.rollout.agentscope_workflow=null",
        "astuner.rollout.max_model_len=1024", "astuner.data.max_prompt_length=900",  # the tools' prompt
        "astuner.task_judge.judge_protocol='astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge'",
    ])
    assert leaves - reads_h - inactive_h - READ_WHILE_LOADING == set()
    later |= {f"astuner.teacher.{k}" for k in ("api", "served_model", "api_key_env", "batch_size")}
    # verifiers lives in an environment of its own (.venv-vf): its reader's keys are read in tests/test_verifiers.py.
    later |= {k for k in leaves if k.startswith("astuner.task_reader.verifiers.")}
    assert (leaves - reads_a - reads_b - reads_c - reads_d - reads_e - reads_f - reads_g - reads_h
            - READ_WHILE_LOADING) == later


def test_the_recorder_notices_an_unread_key(tmp_path, tiny_model_dir):
    loaded = load_config(write_run(tmp_path, tiny_model_dir))
    reads: set[str] = set()
    typed = Recorder(loaded.typed, "", reads)
    assert typed.astuner.data.shuffle is True and typed.astuner.rollout.multi_turn.max_sample_per_task == 4
    assert reads == {"astuner.data.shuffle", "astuner.rollout.multi_turn.max_sample_per_task"}


# --- exact resume ---------------------------------------------------------------------------------------------

VOLATILE = ("time/", "perf/", "actor/train_tokens_per_s")


def stable_metrics(out: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        merged = rows.setdefault(row["step"], {})
        # Training and validation rows of one step hold different keys; a key twice means a step logged twice.
        assert not (set(merged) - {"step"}) & (set(row) - {"step"}), f"step {row['step']} logged twice"
        merged.update({k: v for k, v in row.items() if not k.startswith(VOLATILE)})
    return rows


@pytest.mark.slow
def test_four_steps_equal_two_steps_a_kill_and_two_resumed_steps(tmp_path, tiny_model_dir):
    straight = write_run(tmp_path / "straight", tiny_model_dir)
    assert main(["--conf", str(straight)]) == 0

    resumed = write_run(tmp_path / "resumed", tiny_model_dir)
    out = tmp_path / "resumed" / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "--conf", str(resumed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "global_step_2" / "astuner_resume" / "state.json").exists():
        assert proc.poll() is None, "the run ended before its step-2 checkpoint"
        assert time.monotonic() < deadline, "no step-2 checkpoint in 240 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # a hard kill: no cleanup, possibly in the middle of step 3
    proc.wait()
    assert not (out / "global_step_4").exists()

    assert main(["--conf", str(resumed)]) == 0  # resume_mode auto
    assert "resumed at step 2" in (out / "astuner.log").read_text()

    a = load_file(str(tmp_path / "straight" / "out" / "global_step_4" / "model.safetensors"))
    b = load_file(str(out / "global_step_4" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    # Weights moved at all (lr 1e-3), so equality is not trivially "nothing trained".
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(initial[n], a[n]) for n in a if n in initial)
    ma, mb = stable_metrics(tmp_path / "straight" / "out"), stable_metrics(out)
    assert sorted(ma) == sorted(mb) == [1, 2, 3, 4]
    for step in ma:
        assert mb[step] == pytest.approx(ma[step], rel=1e-5, abs=1e-6), step


def test_a_folder_with_a_run_is_never_appended_to(tmp_path, tiny_model_dir, capsys):
    from astuner.resume import plan_start

    yaml = write_run(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    start = plan_start(load_config(yaml))  # auto, but no complete checkpoint there
    assert start.checkpoint is None and start.loaded.experiment_dir == tmp_path / "out_1"
    assert "starting a fresh run in" in start.message and "no complete checkpoint" in start.message
    (out / "global_step_2" / "astuner_resume").mkdir(parents=True)
    (out / "global_step_2" / "astuner_resume" / "state.json").write_text("{}")
    assert plan_start(load_config(yaml)).checkpoint == out / "global_step_2"
    disabled = plan_start(load_config(yaml, ["astuner.trainer_common.resume_mode=disable"]))
    assert disabled.checkpoint is None and disabled.loaded.experiment_dir == tmp_path / "out_1"
    assert "resume_mode is disable" in disabled.message


# --- bad input exits 2 with one paragraph, before any model loads --------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load weights fails the test: these errors must come before."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the bad input was reported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def cli_error(capsys, yaml, *overrides) -> str:
    code = main(["--conf", str(yaml), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "astuner: error:" in err and "Traceback (most recent call last)" not in err
    return err


def test_error_in_the_users_workflow_module_shows_their_traceback(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "helpers.py").write_text("def load():\n    return {}['missing']\n")
    (tmp_path / "wf.py").write_text("import helpers\nTABLE = helpers.load()\n")
    err = cli_error(capsys, yaml)
    assert "your workflow module" in err and "wf.py" in err and "KeyError: 'missing'" in err
    assert "Traceback (your code):" in err and "helpers.py\", line 2" in err and "astuner/" not in err.split(
        "Traceback (your code):")[1]


def test_syntax_error_in_the_judge_module(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "judge.py").write_text("def broken(:\n    pass\n")
    err = cli_error(capsys, yaml)
    assert "judge.py" in err and "SyntaxError" in err


def test_error_in_the_judges_init(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "judge.py").write_text(JUDGE + "\n    def __init__(self, config):\n        raise ValueError('no key')\n")
    err = cli_error(capsys, yaml)
    assert "LengthJudge.__init__" in err and "ValueError: no key" in err and "judge.py" in err


def test_errors_in_building_a_term_of_combine(tmp_path, tiny_model_dir, capsys, no_model_load):
    """A term of `combine` is built as the run's one judge is: its constructor's error names the term's key, its
    arguments and the file; arguments its constructor does not take are named as the config's mistake."""
    yaml = write_run(tmp_path, tiny_model_dir)
    raising = "\n    def __init__(self, config, **args):\n        raise ValueError('no key')\n"
    (tmp_path / "judge.py").write_text(JUDGE + raising)
    err = cli_error(capsys, yaml, "astuner.task_judge.combine=[{judge: 'judge.py->LengthJudge', weight: 1.0, "
                                  "args: {target: 3}}]")
    assert "astuner.task_judge.combine[0].judge: LengthJudge.__init__ (with {'target': 3})" in err
    assert "ValueError: no key" in err and "judge.py" in err and "Traceback (your code):" in err
    err = cli_error(capsys, yaml, "astuner.task_judge.combine=[{judge: 'astuner.task_judge.shaping->LengthPenalty', "
                                  "weight: 1.0, args: {tarrget: 3}}]")
    assert "astuner.task_judge.combine[0].judge: LengthPenalty does not take the arguments {'tarrget': 3}" in err
    assert "unexpected keyword argument 'tarrget'" in err


def test_data_that_is_not_utf8(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "train.jsonl").write_bytes('{"question": "caf\u00e9?"}\n'.encode("latin-1"))
    err = cli_error(capsys, yaml)
    assert "train.jsonl, line 1: not UTF-8" in err


def test_model_folder_without_config_or_tokenizer(tmp_path, tiny_model_dir, capsys, no_model_load):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    yaml = write_run(tmp_path / "run1", no_config)
    assert "has no config.json" in cli_error(capsys, yaml)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    yaml = write_run(tmp_path / "run2", no_tokenizer)
    assert "cannot load a tokenizer" in cli_error(capsys, yaml)


def test_max_model_len_beyond_the_models_positions(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    err = cli_error(capsys, yaml, "astuner.rollout.max_model_len=4096")
    assert "max_position_embeddings=2048" in err


def test_a_model_too_big_for_this_machine_is_refused(tmp_path, tiny_model_dir, capsys, no_model_load, monkeypatch):
    monkeypatch.setattr("astuner.preflight.available_memory", lambda device: 1024 * 1024)  # 1 MiB
    yaml = write_run(tmp_path, tiny_model_dir)
    err = cli_error(capsys, yaml)
    assert "needs about" in err and "is available" in err and "memory estimate" in err


@pytest.mark.slow
def test_workflow_loguru_lines_land_in_the_run_log(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    assert main(["--conf", str(yaml), "astuner.trainer_common.total_training_steps=1"]) == 0
    log_text = (tmp_path / "out" / "astuner.log").read_text()
    assert "workflow saw task" in log_text  # the user's loguru logger
    assert "astuner.rollout" in log_text or "astuner.loop" in log_text or "effective config" in log_text
    assert "effective config" in log_text and "python tool sandbox" in log_text
    assert "limits (cuts)" in log_text and "rollout.on_cut train: cut calls train as sampled" in log_text


def test_a_workflow_whose_execute_is_not_async(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "wf.py").write_text(
        "from astuner import Workflow, WorkflowOutput\n\n"
        "class EchoWorkflow(Workflow):\n"
        "    def execute(self, workflow_task, model_tuner):\n"
        "        return WorkflowOutput(reward=1.0)\n"
    )
    assert "must be 'async def execute" in cli_error(capsys, yaml)


def test_per_turn_length_that_leaves_no_room_for_a_prompt(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    err = cli_error(capsys, yaml, "astuner.rollout.max_response_length_in_one_turn=256")
    assert "leaves no room for a prompt" in err


def test_huggingface_reader_with_a_file_that_is_not_utf8(tmp_path, tiny_model_dir, capsys, no_model_load):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_bytes('{"question": "caf\u00e9?"}\n'.encode("latin-1"))
    err = cli_error(capsys, yaml, "astuner.task_reader.type=huggingface_dat_repo",
                    f"astuner.task_reader.huggingface_dat_repo.dataset_path={tmp_path / 'ds'}")
    assert "cannot read the data files" in err


def test_a_judge_that_returns_the_wrong_shape_stops_the_run(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "judge.py").write_text(
        "from astuner.task_judge.base_judge import BaseJudge\n\n"
        "class LengthJudge(BaseJudge):\n"
        "    def compute_reward(self, workflow_task, workflow_output):\n"
        "        return 0.5\n"
    )
    err = cli_error(capsys, yaml)
    assert "returned 0.5; it must return (reward: float, is_success: bool)" in err
