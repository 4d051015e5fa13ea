"""tune() and its config objects, function workflows and judges (tune() and YAML), dataset preview, and reward
shaping with hand-computed values."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys

import pytest
import yaml

from astuner import (
    AlgorithmConfig,
    AuxiliaryModelConfig,
    DatasetConfig,
    EnvConfig,
    JudgeOutput,
    TunerModelConfig,
    WorkflowOutput,
    tune,
)
from astuner.cli import main
from astuner.errors import UserError
from astuner.task_judge.shaping import (
    CombinedJudge,
    FormatReward,
    LengthPenalty,
    StepBonus,
    Term,
    format_reward,
    length_penalty,
    step_bonus,
)
from astuner.task_judge.base_judge import FunctionJudge
from astuner.types import Task
from astuner.workflow import WorkflowTask
from conftest import REPO

TUNE_DIR = REPO / "tutorial" / "tune_api"


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # tune() names the functions as module->function, as a YAML would
    spec.loader.exec_module(module)
    return module


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_agentscope_tuner_example_runs_one_step(tmp_path, tiny_model_dir):
    example = _import(TUNE_DIR / "react_tune.py", "react_tune")
    code = tune(
        workflow_func=example.run_react_agent, judge_func=example.judge_function,
        model=TunerModelConfig(model_path=str(tiny_model_dir), max_model_len=2048, max_tokens=16, engine="hf"),
        train_dataset=DatasetConfig(path=str(TUNE_DIR / "my_dataset"), split="train"),
        algorithm=AlgorithmConfig(algorithm_type="multi_step_grpo", group_size=2, batch_size=2,
                                  learning_rate=1e-6, total_steps=1),
        experiment_dir=str(tmp_path / "run"),
        auxiliary_models={"helper": AuxiliaryModelConfig(model_path=str(tiny_model_dir), max_tokens=4)},
    )
    assert code == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["astuner"]
    assert saved["auxiliary_models"]["helper"]["max_tokens"] == 4
    assert saved["rollout"]["agentscope_workflow"] == "react_tune->run_react_agent"
    assert saved["task_judge"]["judge_protocol"] == "react_tune->judge_function"
    assert (saved["rollout"]["num_repeat"], saved["data"]["train_batch_size"]) == (2, 2)
    (row,) = _metrics(tmp_path / "run")
    assert row["train/failure_rate"] == 0.0 and (tmp_path / "run" / "global_step_1").is_dir()


def test_preview_prints_the_first_rows(capsys):
    rows = DatasetConfig(path=str(TUNE_DIR / "my_dataset"), split="train").preview(n=2)
    out = capsys.readouterr().out
    assert len(rows) == 2 and "first 2 rows" in out and "question=" in out and "answer=" in out
    assert DatasetConfig(path=str(REPO / "tutorial/quickstart/data/val.jsonl")).rows(3)[0]["id"]
    with pytest.raises(UserError, match="reply"):
        DatasetConfig(path=str(TUNE_DIR / "my_dataset"), query_field="reply").preview()


QUICK = ["astuner.rollout.engine=hf", "astuner.trainer_common.total_training_steps=1", "astuner.data.train_batch_size=2",
         "astuner.rollout.num_repeat=2", "astuner.trainer_common.val_before_train=false"]


@pytest.mark.slow
def test_function_workflow_and_judge_through_yaml_and_tune_config_path(tmp_path, tiny_model_dir):
    overrides = QUICK + [f"astuner.model.path={tiny_model_dir}"]
    assert main(["--conf", str(TUNE_DIR / "quickstart_tune.yaml"), f"astuner.experiment_dir={tmp_path / 'a'}",
                 *overrides]) == 0
    assert "train/metrics/boxed" in _metrics(tmp_path / "a")[0]  # the judge's own metric, logged per step
    quick = _import(TUNE_DIR / "quickstart_tune.py", "quickstart_tune")
    assert tune(workflow_func=quick.add_numbers, judge_func=quick.boxed_sum,
                config_path=str(TUNE_DIR / "quickstart_tune.yaml"),
                overrides=overrides + [f"astuner.experiment_dir={tmp_path / 'b'}"]) == 0
    saved = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["astuner"]
    assert saved["rollout"]["agentscope_workflow"] == "quickstart_tune->add_numbers"


def sync_workflow(task, model, aux):
    return WorkflowOutput()


def test_bad_tune_arguments_are_clear_errors(tmp_path):
    async def local(task, model, aux):
        return WorkflowOutput()

    data = DatasetConfig(path=str(TUNE_DIR / "my_dataset"))
    with pytest.raises(UserError, match="module level"):
        tune(workflow_func=local, train_dataset=data)
    with pytest.raises(UserError, match="async def"):
        tune(workflow_func=sync_workflow, train_dataset=data)
    quick = _import(TUNE_DIR / "quickstart_tune.py", "quickstart_tune")
    with pytest.raises(UserError, match="multi_step_grpo"):
        tune(workflow_func=quick.add_numbers, train_dataset=data, algorithm=AlgorithmConfig(algorithm_type="ppo"))
    with pytest.raises(UserError, match="train_dataset"):
        tune(workflow_func=quick.add_numbers)


GAME = EnvConfig("textarena", {"env_id": "GuessTheNumber-v0", "size": 4, "validation_size": 2,
                               "env_kwargs": {"min_number": 1, "max_number": 5, "max_turns": 2}, "max_turns": 2})


def test_an_environment_others_wrote_is_named_not_coded(tmp_path):
    from astuner.config import load_config
    from astuner.task_judge.loading import judge_spec
    from astuner.workflow import workflow_spec
    from astuner.tune_api import build_yaml

    tree = build_yaml(workflow_spec=None, judge_spec=None, model=None, train_dataset=None, eval_dataset=None,
                      algorithm=AlgorithmConfig(group_size=2, batch_size=2), project_name="g", experiment_dir=None,
                      env=GAME)
    assert tree["astuner"]["task_reader"] == {"type": "textarena", "textarena": GAME.args}
    assert tree["astuner"]["trainer_common"]["val_before_train"]  # an environment has its validation tasks
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(tree))
    typed = load_config(path).typed  # the schema checks the arguments, as a YAML's
    assert workflow_spec(typed) == "astuner.environments.textarena->GameWorkflow"
    assert judge_spec(typed) == "astuner.environments.textarena->GameJudge"
    with pytest.raises(UserError, match=r"kind='textarna' .* reasoning_gym, textarena"):
        tune(env=EnvConfig("textarna"))
    with pytest.raises(UserError, match="leave train_dataset and eval_dataset out"):
        tune(env=GAME, train_dataset=DatasetConfig(path=str(TUNE_DIR / "my_dataset")))
    with pytest.raises(UserError, match=r"workflow_func=your agent, or env=EnvConfig"):
        tune()


@pytest.mark.slow
def test_tune_trains_an_environment_with_no_code_of_its_own(tmp_path, tiny_model_dir):
    assert tune(env=GAME, model=TunerModelConfig(model_path=str(tiny_model_dir), max_model_len=1024, max_tokens=8,
                                                 engine="hf"),
                algorithm=AlgorithmConfig(group_size=2, batch_size=2, total_steps=1),
                experiment_dir=str(tmp_path / "run")) == 0
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 1] and "val/metrics/unfinished" in rows[0]  # the game's metrics
    assert rows[1]["env/failed"] == 0.0 and rows[1]["train/failure_rate"] == 0.0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["astuner"]
    assert saved["task_reader"]["type"] == "textarena" and saved["rollout"]["agentscope_workflow"] is None


# --- reward shaping ---------------------------------------------------------------------------------------------


def test_shapes_by_hand():
    assert length_penalty(300, target=256, alpha=0.01) == pytest.approx(-0.44)
    assert length_penalty(200, target=256, alpha=0.01) == 0.0
    assert step_bonus(3, per_step=0.1, max_steps=5) == pytest.approx(0.3)
    assert step_bonus(9, per_step=-0.05, max_steps=5) == pytest.approx(-0.25)
    assert format_reward("so \\boxed{7}", r"\\boxed\{.+\}") == 1.0 and format_reward("7", r"\\boxed\{.+\}") == 0.0


def _judge_input(text="The answer is \\boxed{42}", tokens=15, calls=3):
    task = WorkflowTask(Task("t1", "q", metadata={"answer": "42"}), 0, "e", False)
    return task, WorkflowOutput(response=text, stats={"calls": calls, "response_tokens": tokens})


async def exact(task, response, aux):
    return JudgeOutput(reward=1.0 if task["answer"] in response else 0.0)


def test_combined_judge_weighted_sum_and_terms_as_metrics():
    judge = CombinedJudge([
        ("accuracy", 1.0, FunctionJudge(exact), False),
        ("length", 1.0, LengthPenalty(target=10, alpha=0.1), False),
        ("steps", 0.5, StepBonus(per_step=0.2, max_steps=2), False),
        ("format", 0.25, FormatReward(), False),
    ])
    task, output = _judge_input()
    reward, success = asyncio.run(judge.compute_reward(task, output))
    # 1.0 * 1 + 1.0 * (-0.1 * (15 - 10)) + 0.5 * (0.2 * min(3, 2)) + 0.25 * 1 = 1 - 0.5 + 0.2 + 0.25
    assert reward == pytest.approx(0.95) and success is True  # success: the first term's
    assert output.metrics == pytest.approx({"reward/accuracy": 1.0, "reward/length": -0.5, "reward/steps": 0.4,
                                            "reward/format": 1.0})
    wrong_task, wrong = _judge_input("no idea", tokens=5)
    assert asyncio.run(judge.compute_reward(wrong_task, wrong)) == (pytest.approx(0.2), False)
    with pytest.raises(UserError, match="names must differ"):
        CombinedJudge([("a", 1.0, LengthPenalty(), False), ("a", 1.0, StepBonus(), False)])


def test_a_term_set_if_success_counts_only_for_a_right_answer():
    # if_success: the length term breaks ties among right answers; a wrong one is not charged (nor pushed shorter).
    judge = CombinedJudge([Term("accuracy", 1.0, FunctionJudge(exact)),
                           Term("length", 1.0, LengthPenalty(target=10, alpha=0.1), if_success=True)])
    task, output = _judge_input()  # right, 15 tokens: 1 - 0.1 * (15 - 10)
    assert asyncio.run(judge.compute_reward(task, output)) == (pytest.approx(0.5), True)
    assert output.metrics == pytest.approx({"reward/accuracy": 1.0, "reward/length": -0.5})
    wrong_task, wrong = _judge_input("no idea", tokens=40)
    assert asyncio.run(judge.compute_reward(wrong_task, wrong)) == (0.0, False)
    assert wrong.metrics == {"reward/accuracy": 0.0, "reward/length": 0.0}  # the term as counted
    with pytest.raises(UserError, match="cannot set if_success"):
        CombinedJudge([Term("accuracy", 1.0, FunctionJudge(exact), success=True, if_success=True)])


@pytest.mark.slow
def test_combine_from_the_yaml_logs_each_term(tmp_path, tiny_model_dir):
    combine = ("[{judge: 'quickstart_tune.py->boxed_sum', weight: 1.0, name: accuracy}, "
               "{judge: 'astuner.task_judge.shaping->LengthPenalty', weight: 1.0, args: {target: 4, alpha: 0.01}}]")
    assert main(["--conf", str(TUNE_DIR / "quickstart_tune.yaml"), f"astuner.experiment_dir={tmp_path}",
                 f"astuner.model.path={tiny_model_dir}", f"astuner.task_judge.combine={combine}", *QUICK]) == 0
    row = _metrics(tmp_path)[0]
    assert "train/metrics/reward/accuracy" in row and row["train/metrics/reward/LengthPenalty"] < 0


# --- auxiliary models and the LLM judge -------------------------------------------------------------------------

from astuner.task_judge.llm_judge import LLMJudge, parse_score  # noqa: E402


def test_parse_score_forms():
    assert parse_score("Good.\nScore: 7", 10) == 7.0
    assert parse_score("**Score**: 8.5 overall", 10) == 8.5
    assert parse_score("score = 3\n... on reflection Score: 6", 10) == 6.0  # the last one wins
    assert parse_score("I give it 4/5", 10) == 8.0
    assert parse_score("\\boxed{9}", 10) == 9.0
    assert parse_score("Score: 14", 10) == 10.0 and parse_score("Score: -2", 10) == 0.0  # clamped
    assert parse_score("no number here", 10) is None


class ScriptedAux:
    def __init__(self, answers):
        self.answers, self.prompts = list(answers), []

    async def chat(self, messages, tools=None):
        self.prompts.append(messages[-1]["content"])
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {"role": "assistant", "content": answer}


def _aux_input(aux):
    task = WorkflowTask(Task("t", "What is 6*7?", metadata={"answer": "42"}), 0, "e", False, {"judge": aux})
    return task, WorkflowOutput(response="It is 42.")


def test_llm_judge_retries_records_reasoning_and_fails_loudly():
    aux = ScriptedAux([ConnectionError("down"), "I am unsure.", "Correct, matches 42. Score: 8"])
    task, output = _aux_input(aux)
    reward, success = asyncio.run(LLMJudge(retries=2).compute_reward(task, output))
    assert (reward, success) == (pytest.approx(0.8), True)
    assert output.metadata["judge_reasoning"].endswith("Score: 8") and output.metrics["judge/score"] == 8.0
    assert "What is 6*7?" in aux.prompts[0] and "42" in aux.prompts[0] and "It is 42." in aux.prompts[0]
    task, output = _aux_input(ScriptedAux(["no", "still no"]))
    with pytest.raises(RuntimeError, match="no score"):
        asyncio.run(LLMJudge(retries=1).compute_reward(task, output))
    with pytest.raises(UserError, match="auxiliary_models.grader"):
        asyncio.run(LLMJudge(model="grader").compute_reward(*_aux_input(ScriptedAux([]))))


AUX_WORKFLOW = '''
from astuner import WorkflowOutput, JudgeOutput

async def ask_both(task, model, auxiliary_models):
    hint = await auxiliary_models["helper"].chat([{"role": "user", "content": "Hint for: " + task["question"]}])
    reply = await model.chat([{"role": "user", "content": task["question"] + " " + hint["content"][:40]}])
    return WorkflowOutput(response=reply["content"])

async def graded(task, response, auxiliary_models):
    verdict = await auxiliary_models["judge"].chat([{"role": "user", "content": "Grade: " + response}])
    return JudgeOutput(reward=1.0 if "Score: 7" in verdict["content"] else 0.0, metrics={"graded": 1.0})
'''
SECRET = "sk-test-never-written-0123456789"


@pytest.mark.slow
def test_auxiliary_models_local_and_endpoint_and_the_key_never_saved(tmp_path, tiny_model_dir, monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from conftest import serve_in_thread

    seen = []

    async def completions(request):
        seen.append(request.headers.get("authorization"))
        body = await request.json()
        return JSONResponse({"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "Fine. Score: 7"}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})

    url, stop = serve_in_thread(Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])]))
    monkeypatch.setenv("STUB_KEY", SECRET)
    (tmp_path / "aux_flow.py").write_text(AUX_WORKFLOW)
    out = tmp_path / "out"
    try:
        code = main([
            "--conf", str(TUNE_DIR / "quickstart_tune.yaml"), f"astuner.experiment_dir={out}",
            f"astuner.model.path={tiny_model_dir}", *QUICK,
            f"astuner.rollout.agentscope_workflow='{tmp_path / 'aux_flow.py'}->ask_both'",
            f"astuner.task_judge.judge_protocol='{tmp_path / 'aux_flow.py'}->graded'",
            f"+astuner.auxiliary_models.helper.model_path={tiny_model_dir}",
            "+astuner.auxiliary_models.helper.max_tokens=8",
            f"+astuner.auxiliary_models.judge.base_url={url}/v1",
            "+astuner.auxiliary_models.judge.api_key_env=STUB_KEY",
        ])
    finally:
        stop()
    assert code == 0
    assert seen and all(h == f"Bearer {SECRET}" for h in seen)  # the endpoint got the key from the environment
    row = _metrics(out)[0]
    assert row["train/metrics/aux/judge/calls"] == 1.0 and row["train/metrics/aux/helper/calls"] == 1.0
    assert row["train/metrics/aux/helper/tokens"] > 0 and row["train/reward_mean"] == 1.0
    # Only the policy's calls are samples: one call per episode.
    assert row["train/turns_per_episode"] == 1.0
    for path in out.rglob("*"):
        if path.is_file() and path.suffix != ".safetensors":
            assert SECRET.encode() not in path.read_bytes(), path


def test_bad_auxiliary_entries_exit_2_before_loading(tmp_path, capsys):
    conf = str(TUNE_DIR / "quickstart_tune.yaml")
    assert main(["--conf", conf, f"astuner.experiment_dir={tmp_path}", "+astuner.auxiliary_models.j.base_ur=x"]) == 2
    assert "auxiliary_models.j.base_ur" in capsys.readouterr().err
    assert main(["--conf", conf, f"astuner.experiment_dir={tmp_path}", "+astuner.auxiliary_models.j.max_tokens=0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


SCRIPT = '''
import sys
from astuner import AlgorithmConfig, DatasetConfig, JudgeOutput, TunerModelConfig, WorkflowOutput, tune


def words(text):  # a helper in the script's __main__: shipped with the judge that uses it
    return len((text or "").split())


async def run_agent(task, model, auxiliary_models):
    reply = await model.chat([{"role": "user", "content": task["question"]}])
    print("agent-reply-echo", len(reply["content"] or ""))  # as agent frameworks echo replies
    return WorkflowOutput(response=reply["content"])


async def judge(task, response, auxiliary_models):
    return JudgeOutput(reward=min(words(response) / 8, 1.0))


if __name__ == "__main__":
    model_path, data, out, with_ray = sys.argv[1:5]
    tune(workflow_func=run_agent, judge_func=judge, backbone="verl", with_ray=with_ray == "1",
         model=TunerModelConfig(model_path=model_path, max_model_len=256, max_tokens=8, engine="hf"),
         train_dataset=DatasetConfig(path=data, task_id_field="id"),
         algorithm=AlgorithmConfig(group_size=2, batch_size=2, learning_rate=1e-5, total_steps=1,
                                   extra={"trainer_common.cpus_per_worker": 0.5}),
         experiment_dir=out)
'''


@pytest.mark.slow
def test_tune_from_a_script_on_the_verl_backbone_ships_its_functions(tmp_path, tiny_model_dir):
    """A script's functions live in its __main__, which a Ray worker does not have: tune() ships them by value."""
    import os
    import subprocess

    script = tmp_path / "train_agent.py"
    script.write_text(SCRIPT)
    data = REPO / "tutorial" / "quickstart" / "data" / "train.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)

    def launch(out, with_ray):
        return subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(data), str(out), with_ray],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    # Without --with-ray (with_ray=True) and no cluster running, nothing is started: the error says what to do.
    refused = launch(tmp_path / "refused", "0")
    assert refused.returncode != 0 and "no Ray cluster to join" in refused.stderr and "with_ray=True" in refused.stderr
    done = launch(tmp_path / "run", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["astuner"]
    assert saved["rollout"]["agentscope_workflow"].endswith("run_agent.functions.pkl->run_agent")
    assert saved["task_judge"]["judge_protocol"].endswith("run_agent.functions.pkl->judge")
    (row,) = _metrics(tmp_path / "run")
    assert row["train/failure_rate"] == 0.0 and row["train/reward_mean"] > 0  # the shipped judge (and helper) ran
    # The agent's prints in the Ray worker: in the run's log, not forwarded to the console by Ray
    assert "agent-reply-echo" not in done.stdout + done.stderr
    assert "print: agent-reply-echo" in (tmp_path / "run" / "astuner.log").read_text()


def test_a_default_the_user_did_not_set_is_derived_to_fit_the_one_they_did(tmp_path):
    """The seed's example sets max_model_len=1024 and leaves max_tokens alone: the per-turn default (1024) would
    leave no room for a prompt, so it becomes half of max_model_len, and the start says so."""
    from astuner.config import load_config
    from astuner.tune_api import build_yaml

    tree = build_yaml(workflow_spec="m->f", judge_spec="m->j", model=TunerModelConfig(max_model_len=1024),
                      train_dataset=DatasetConfig(path=str(REPO / "tutorial" / "tune_api" / "my_dataset"),
                                                  split="train"),
                      eval_dataset=None, algorithm=AlgorithmConfig(), project_name="p", experiment_dir=None,
                      auxiliary_models=None)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tree))
    loaded = load_config(path)
    assert loaded.typed.astuner.rollout.max_response_length_in_one_turn == 512
    assert "half of max_model_len=1024" in loaded.derived[0]
    # A value the user set is theirs: both set and contradictory stays an error (tests/test_run_contract.py).
    explicit = load_config(path, ["astuner.rollout.max_response_length_in_one_turn=1000"])
    assert explicit.typed.astuner.rollout.max_response_length_in_one_turn == 1000 and explicit.derived == ()
