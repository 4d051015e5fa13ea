"""The debug backbone end to end on a tiny random model with the real demo tokenizer, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tolerances import LOGPROB_ATOL
from transformers import AutoModelForCausalLM

from astuner.cli import main

WORKFLOW = '''
from astuner import Workflow, WorkflowOutput

class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
'''
JUDGE = '''
from astuner.task_judge.base_judge import BaseJudge

class LengthJudge(BaseJudge):
    """Rewards longer answers (uncapped): random text always has a reward spread, so GRPO has a gradient."""
    def compute_reward(self, workflow_task, workflow_output):
        n = len(workflow_output.metadata["final_answer"])
        return n / 100.0, n > 80
'''


def write_run(tmp_path: Path, model_dir: Path, extra: str = "") -> Path:
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "judge.py").write_text(JUDGE)
    rows = [{"question": f"Say something about {w}.", "answer": w} for w in ["cats", "rain", "maps", "tea"]]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(f"""
astuner:
  project_name: tiny
  model: {{path: {model_dir}}}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file: {{training: {{file_path: train.jsonl}}, validation: {{file_path: val.jsonl}}}}
  data: {{train_batch_size: 2, max_response_length: 64}}
  rollout: {{engine: hf, agentscope_workflow: wf.py->EchoWorkflow, num_repeat: 3, temperature: 1.0,
            max_response_length_in_one_turn: 16, max_model_len: 256, compute_madness_checklist: []}}
  task_judge: {{judge_protocol: judge.py->LengthJudge}}
  trainer_common: {{total_training_steps: 2, test_freq: 1, save_freq: 1, optim: {{lr: 1.0e-3}}}}
trinity: {{trainer: {{max_token_len_per_gpu: 512}}}}
{extra}""")
    return yaml


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("run")
    yaml = write_run(tmp, tiny_model_dir)
    out = tmp / "out"
    code = main(["--conf", str(yaml), "--backbone", "debug", f"astuner.experiment_dir={out}"])
    assert code == 0
    return out


@pytest.mark.slow
def test_checkpoints_load_and_weights_changed(finished_run, tiny_model_dir):
    assert sorted(p.name for p in finished_run.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    trained = AutoModelForCausalLM.from_pretrained(finished_run / "global_step_2")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for (n, a), (_, b) in zip(trained.named_parameters(), initial.named_parameters()) if not torch.equal(a, b)]
    assert len(changed) > 0.9 * len(list(initial.parameters()))
    assert (finished_run / "global_step_2" / "tokenizer_config.json").is_file()


def test_tensorboard_holds_the_scalars(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(finished_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ["train/reward_mean", "train/reward_std", "train/success_rate", "val/accuracy", "train/response_length",
                "train/turns_per_episode", "train/madness_rate", "train/failure_rate", "actor/policy_loss",
                "actor/clip_fraction", "actor/entropy", "actor/grad_norm", "actor/lr", "time/rollout_s",
                "time/train_s", "time/sync_s", "perf/rollout_tokens_per_s", "actor/train_tokens_per_s"]:
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("val/accuracy")] == [0, 1, 2]


def test_outputs_config_log_metrics_trajectories(finished_run):
    assert (finished_run / "config.yaml").is_file() and (finished_run / "tiny.yaml").is_file()
    assert "validation accuracy" in (finished_run / "astuner.log").read_text()
    steps = [json.loads(line)["step"] for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 1, 2, 2]  # validation at 0, then train + validation per step
    episodes = [json.loads(l) for l in (finished_run / "trajectories" / "train_step_000001.jsonl").read_text().splitlines()]
    assert len(episodes) == 6 and all(e["calls"] and e["calls"][0]["prompt"].startswith("<|im_start|>") for e in episodes)


def test_engine_logprobs_equal_trainer_logprobs_after_sync(tmp_path, tiny_model_dir):
    """After a real training step and weight sync, the engine samples from exactly the trainer's policy."""
    from astuner.backbone.debug import InProcessStages
    from astuner.config import load_config
    from astuner.run_models import build_runtime
    from astuner.types import SamplingParams

    loaded = load_config(write_run(tmp_path, tiny_model_dir), [f"astuner.experiment_dir={tmp_path / 'out'}"])
    rt = build_runtime(loaded)
    stages = InProcessStages(rt.runner, rt.trainer, rt.engine, tmp_path / "out", rt.tokenizer)
    from astuner.algorithm.samples import episodes_to_samples

    episodes = stages.rollout(rt.train_tasks[:2], validation=False)
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=True, epsilon=1e-6,
                                  max_sample_per_task=4)
    before = rt.trainer.compute_logprobs(samples[0].prompt_ids, samples[0].response_ids, 1.0)
    trained = stages.train(samples)
    assert trained.metrics["grad_norm"] > 0
    assert len(trained.trainer_logprobs) == len(samples)
    after = rt.trainer.compute_logprobs(samples[0].prompt_ids, samples[0].response_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-4  # the policy moved
    stages.sync_weights()
    prompt = samples[0].prompt_ids
    res = rt.engine.generate_batch([prompt], SamplingParams(temperature=0.8, max_tokens=12))[0]
    trainer_lp = rt.trainer.compute_logprobs(prompt, res.token_ids, 0.8)
    assert max(abs(a - b) for a, b in zip(res.logprobs, trainer_lp)) < LOGPROB_ATOL
    rt.engine.shutdown()


def test_bad_workflow_path_is_a_clean_error(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir)
    code = main(["--conf", str(yaml), "astuner.rollout.agentscope_workflow=missing.py->Nope",
                 f"astuner.experiment_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "missing.py" in err and "Traceback" not in err


def test_misspelt_workflow_class_names_the_file_its_workflows_and_the_closest_name(tmp_path, capsys):
    """Checked before any model loads: the model folder does not even exist."""
    yaml = write_run(tmp_path, tmp_path / "no_such_model")
    yaml.write_text(yaml.read_text().replace("wf.py->EchoWorkflow", "agent.py->UnitAgnet"))  # as a user writes it
    (tmp_path / "agent.py").write_text(WORKFLOW.replace("EchoWorkflow", "UnitAgent") + JUDGE + "\ndef helper():\n"
                                       "    pass\n")
    code = main(["--conf", str(yaml), "--backbone", "debug", f"astuner.experiment_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "astuner_user_" not in err
    assert f"agent.py ({(tmp_path / 'agent.py').resolve()}) defines no 'UnitAgnet'; did you mean 'UnitAgent'?" in err
    assert "Its workflows and judges: LengthJudge, UnitAgent. Its other classes and functions: helper." in err


def test_misspelt_class_of_a_module_names_the_module_file_and_the_closest_name(tmp_path):
    from astuner.workflow import ClassSpecError, load_class

    (tmp_path / "unit_pkg").mkdir()
    (tmp_path / "unit_pkg" / "__init__.py").write_text("")
    (tmp_path / "unit_pkg" / "agents.py").write_text(WORKFLOW.replace("EchoWorkflow", "UnitAgent"))
    with pytest.raises(ClassSpecError) as caught:
        load_class("unit_pkg.agents->UnitAgnet", [tmp_path])
    assert str(caught.value) == (
        f"'unit_pkg.agents->UnitAgnet': unit_pkg.agents ({tmp_path.resolve() / 'unit_pkg' / 'agents.py'}) defines no "
        "'UnitAgnet'; did you mean 'UnitAgent'? Its workflows and judges: UnitAgent. Write 'unit_pkg.agents->Name' "
        "with a name it defines.")


def test_rollout_progress_counts_every_episode():
    from types import SimpleNamespace

    from astuner.backbone.debug import InProcessStages

    class Runner:
        settings = SimpleNamespace(num_repeat=3)

        def run(self, tasks, validation, on_episode_done=None, step=0, sampled_repeats=None):
            for _ in range(len(tasks) * ((sampled_repeats or 1) if validation else 3)):
                on_episode_done(None)
            return []

    bars = []

    class Bar:
        def __init__(self, desc, total):
            self.desc, self.total, self.n = desc, total, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, k):
            self.n += k

    stages = InProcessStages(Runner(), None, None, Path("."), None)
    stages.rollout([object()] * 4, validation=False, progress=Bar)
    stages.rollout([object()] * 4, validation=True, progress=Bar)
    stages.rollout_sampled([object()] * 4, step=0, repeats=5, progress=Bar)  # pass@k validation
    assert [(b.desc, b.total, b.n) for b in bars] == [("rollout", 12, 12), ("validation", 4, 4),
                                                      ("validation", 20, 20)]


def test_a_missing_file_names_each_folder_looked_in_once(tmp_path, monkeypatch):
    from astuner.workflow import ClassSpecError, load_class

    monkeypatch.chdir(tmp_path)  # the YAML's folder is the working directory, as in most runs
    with pytest.raises(ClassSpecError) as caught:
        load_class("missing.py->Agent", [tmp_path])
    assert f"file 'missing.py' not found (looked in {tmp_path.resolve()})" in str(caught.value)
