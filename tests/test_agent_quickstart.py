"""The agent quick-start (tutorial/agent_quickstart/) in its three forms, trained 2 steps each through the CLI on
the tiny random model with the tutorial's YAML, only the workflow line changed: the OpenAI SDK loop, an AgentScope
ReActAgent with a Toolkit, and a tune() function workflow. The tiny model cannot write a tool call, so each
episode's first two calls are scripted (find_badge with the asked name, then lookup_code with the badge the first
tool returned), forced and scored by the model itself (tests/scripted_engine.py); the rest is the real pipeline:
the hermes parser, the tools, the token-exact next prompt, merge and the trainer. The recipe's data and the
warm-start demonstrations are checked too."""

from __future__ import annotations

import json
import re
import sys

import pytest
from scripted_engine import hermes_call, install

from conftest import REPO

TUTORIAL = REPO / "tutorial" / "agent_quickstart"
STYLES = {
    "openai_sdk": "openai_agent.py->OpenAILookupAgent",
    "react_agent": "react_agent.py->ReActLookupAgent",
    "tune_function": "tune_agent.py->run_agent",
}


def answer_first_repeat(prompt: str, request_id: str) -> str:
    """The third call: repeat 0 of each task boxes the code the second tool returned, repeat 1 boxes the badge, so
    every group has a reward to learn from (episode uids end in '#<repeat>')."""
    code, badge = re.findall(r"access code ([A-Z]{2}-\d{4})\.", prompt)[-1], re.findall(r"badge (\d{4})", prompt)[-1]
    return f"The code is \\boxed{{{code if request_id.split('/')[0].endswith('#0') else badge}}}."


SCRIPT = {0: hermes_call("find_badge", "name", r"access code of ([A-Z][a-z]+ [A-Z][a-z]+)\?"),
          1: hermes_call("lookup_code", "badge", r"has badge (\d{4})\."), 2: answer_first_repeat}


@pytest.fixture
def lookup_task(monkeypatch):
    monkeypatch.syspath_prepend(str(TUTORIAL))
    import lookup_task

    yield lookup_task
    sys.modules.pop("lookup_task", None)


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.slow
def test_agent_style_trains_multi_turn_with_its_tools(tmp_path, tiny_model_dir, monkeypatch, lookup_task, style):
    from astuner.cli import main

    engines = install(monkeypatch, SCRIPT)
    code = main(["--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}",
                 "astuner.rollout.engine=hf", f"astuner.rollout.agentscope_workflow='{STYLES[style]}'",
                 "astuner.data.train_batch_size=2", "astuner.rollout.num_repeat=2",
                 "astuner.rollout.max_response_length_in_one_turn=40", "astuner.rollout.compute_madness_checklist=[]",
                 "astuner.trainer_common.val_before_train=false", "astuner.trainer_common.total_training_steps=2",
                 "astuner.trainer_common.test_freq=99", "astuner.trainer_common.save_freq=99"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/failure_rate" in r]
    assert len(train) == 2
    for row in train:
        assert row["train/failure_rate"] == 0 and row["rollout/calls_per_episode"] == 3
        assert row["rollout/tool_call_rate"] == 2 and row["rollout/tool_call_parse_failure_rate"] == 0
        assert row["train/success_rate"] == 0.5 and row["actor/train_tokens"] > 0
    for step in (1, 2):
        path = tmp_path / "trajectories" / f"train_step_{step:06d}.jsonl"
        episodes = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(episodes) == 4
        for e in episodes:
            assert not e["error"], e["error_summary"]
            first, second, third = e["calls"][:3]
            name = e["query"].removeprefix("What is the access code of ").removesuffix("?")
            badge = lookup_task.BADGES[name]
            # Each tool call parsed, run, and its result in the next prompt, which extends the previous one.
            assert first["tool_calls"][0]["name"] == "find_badge"
            assert f"{name} has badge {badge}." in second["prompt"]
            assert second["tool_calls"][0]["name"] == "lookup_code"
            assert f"Badge {badge} has access code {lookup_task.CODES[name]}." in third["prompt"]
            assert second["prompt"].startswith(first["prompt"]) and third["prompt"].startswith(second["prompt"])
            assert e["reward"] == (1.0 if e["episode_uid"].endswith("#0") else 0.0)
    assert engines[0].scripted == 3 * 4 * 2 + 3 * 32  # 3 calls x 4 episodes x 2 steps, then the final validation
    if style == "openai_sdk":
        check_log_viewer(tmp_path)


def check_log_viewer(run):
    """The log viewer shows an episode's tool calls, the tool results and the answer, with the loss mask: 1 on
    the model's three responses (all trained: merge joined them into one sample with a non-zero advantage)."""
    from starlette.testclient import TestClient

    from astuner.logview.app import build_app

    client = TestClient(build_app(run.parent))
    base = f"/api/runs/{run.name}"
    item = client.get(f"{base}/episodes", params={"split": "train", "step": 2, "min_reward": 1}).json()["items"][0]
    ep = client.get(f"{base}/episodes/{item['id']}").json()
    call0, call1, call2 = ep["calls"]
    assert [m["role"] for m in call0["messages"]] == ["system", "user", "assistant"]
    assert call0["messages"][-1]["tool_calls"][0]["function"]["name"] == "find_badge"
    # Later calls extend the earlier ones: each stores the tool's result, then the model's reply.
    assert [m["role"] for m in call1["messages"]] == ["tool", "assistant"] == [m["role"] for m in call2["messages"]]
    assert "has badge" in call1["messages"][0]["content"] and "has access code" in call2["messages"][0]["content"]
    assert "\\boxed{" in call2["messages"][1]["content"]
    for call in ep["calls"]:
        assert call["tokens"]["mask"] == [1] * len(call["tokens"]["ids"])
        assert call["tokens"]["advantage"] == pytest.approx(ep["advantage"]) and ep["advantage"] > 0
    check_episode_page(run, item["id"])


def check_episode_page(run, episode_id):
    """The episode page in headless Chromium names each tool call with its arguments (a screenshot is saved)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait
    from test_logview import ARTIFACTS, _browser

    from astuner.logview.app import LogViewServer

    server = LogViewServer(run.parent)
    url = server.start()
    browser = _browser()
    try:
        browser.get(f"{url}#/run/{run.name}/episode/{episode_id}")
        calls = WebDriverWait(browser, 20).until(
            EC.presence_of_all_elements_located((By.CSS_SELECTOR, ".toolcall")))
        texts = [c.text for c in calls]
        assert any(t.startswith("→ find_badge({") for t in texts), texts
        assert any(t.startswith("→ lookup_code({") and "badge" in t for t in texts), texts
        assert browser.find_elements(By.CSS_SELECTOR, ".msg.tool") and browser.find_elements(By.CSS_SELECTOR, "#token-view .tok")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "logview_agent_episode.png"))
    finally:
        browser.quit()
        server.stop()


def test_task_tools_and_judge(lookup_task):
    name = "Mira Okafor"
    badge, code = lookup_task.BADGES[name], lookup_task.CODES[name]
    assert lookup_task.find_badge(" mira  okafor ") == f"{name} has badge {badge}."
    assert lookup_task.lookup_code(badge) == f"Badge {badge} has access code {code}."
    assert "No badge" in lookup_task.lookup_code(name)  # the name is not a badge: the agent reads why
    assert len(set(lookup_task.BADGES.values())) == len(lookup_task.NAMES)  # one person per badge

    class Output:
        metadata = {"final_answer": f"The code is \\boxed{{{code}}}."}

    class WorkflowTask:
        class task:
            metadata = {"answer": code}

    assert lookup_task.CodeJudge().compute_reward(WorkflowTask, Output) == (1.0, True)
    Output.metadata = {"final_answer": f"\\boxed{{{badge}}}"}
    assert lookup_task.CodeJudge().compute_reward(WorkflowTask, Output) == (0.0, False)


def test_data_files_are_what_make_data_writes(tmp_path, lookup_task):
    """The shipped data is make_data.py's output; validation people are never trained on, and no warm-start
    demonstration shows the task's own tools."""
    import subprocess

    copy = tmp_path / "agent_quickstart"
    copy.mkdir()
    for name in ("make_data.py", "lookup_task.py", "lookup_agent.py", "warmup_tools.py"):
        (copy / name).write_text((TUTORIAL / name).read_text())
    subprocess.run([sys.executable, "make_data.py"], cwd=copy, check=True)
    for name in ("train.jsonl", "val.jsonl", "sft_train.jsonl"):
        assert (copy / "data" / name).read_text() == (TUTORIAL / "data" / name).read_text(), name
    train = {json.loads(line)["name"] for line in (TUTORIAL / "data" / "train.jsonl").read_text().splitlines()}
    val = {json.loads(line)["name"] for line in (TUTORIAL / "data" / "val.jsonl").read_text().splitlines()}
    assert not train & val and len(val) == 32
    demos = (TUTORIAL / "data" / "sft_train.jsonl").read_text()
    assert "find_badge" not in demos and "lookup_code" not in demos
