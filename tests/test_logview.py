"""The log viewer: what the monitor stores, the JSON endpoints on a small recorded run, `--with-logview` and
`astuner logview`, and the pages in a real headless Chromium (a screenshot of the token view is saved)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_run_contract import write_run

from astuner.cli import main
from astuner.logview.app import build_app, find_runs
from astuner.logview.store import FILE_NAME
from tolerances import LOGPROB_ATOL

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("ASTUNER_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))

TWO_TURNS = '''
from astuner import Workflow, WorkflowOutput

class TwoTurns(Workflow):
    async def execute(self, workflow_task, model_tuner):
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": workflow_task.task.main_query}]
        messages.append(await model_tuner.chat(messages))
        messages.append({"role": "user", "content": "And again?"})
        reply = await model_tuner.chat(messages)
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
'''


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_model_dir):
    """Two steps of a two-turn workflow on the tiny model, merged samples, validation at step 2."""
    folder = tmp_path_factory.mktemp("logview_run")
    yaml = write_run(folder, tiny_model_dir)
    (folder / "two.py").write_text(TWO_TURNS)
    code = main(["--conf", str(yaml), "astuner.trainer_common.total_training_steps=2",
                 "astuner.rollout.agentscope_workflow='two.py->TwoTurns'", "astuner.trainer_common.test_freq=2",
                 "astuner.rollout.multi_turn.sample_mode=merge"])
    assert code == 0
    return folder / "out"


@pytest.fixture(scope="module")
def client(recorded_run):
    from starlette.testclient import TestClient

    return TestClient(build_app(recorded_run.parent))


@pytest.mark.slow
def test_the_store_holds_every_episode_with_token_data(recorded_run):
    conn = sqlite3.connect(recorded_run / FILE_NAME)
    counts = dict(conn.execute("SELECT split || step, COUNT(*) FROM episodes GROUP BY split, step").fetchall())
    assert counts == {"train1": 6, "train2": 6, "val2": 2}
    rows = conn.execute("SELECT calls.idx, tokens FROM calls JOIN episodes ON id = episode_id "
                        "WHERE split = 'train'").fetchall()
    measured = 0
    for call_index, tokens in rows:
        tokens = json.loads(tokens)
        assert len(tokens["ids"]) == len(tokens["text"]) == len(tokens["logprob"]) == len(tokens["mask"])
        if tokens["trainer_logprob"] is not None:  # forwarded before the update: engine and trainer agree
            assert len(tokens["trainer_logprob"]) == len(tokens["ids"])
            assert max(abs(a - b) for a, b in zip(tokens["trainer_logprob"], tokens["logprob"])) < LOGPROB_ATOL
            measured += call_index == 1  # second calls live inside merged samples, split back along the mask
    assert measured > 0


def test_runs_metrics_and_steps(client):
    runs = client.get("/api/runs").json()["runs"]
    assert [r["id"] for r in runs] == ["out"] and runs[0]["steps"] == 2 and runs[0]["has_trajectories"]
    rows = client.get("/api/runs/out/metrics").json()["rows"]
    assert {r["step"] for r in rows} == {1, 2} and any("val/accuracy" in r for r in rows)
    steps = client.get("/api/runs/out/steps").json()["steps"]
    assert [(s["split"], s["step"], s["episodes"]) for s in steps] == [("train", 1, 6), ("train", 2, 6),
                                                                       ("val", 2, 2)]
    assert client.get("/api/runs/nope/steps").status_code == 404
    assert client.get("/api/runs/..%2F..%2Fetc/metrics").status_code == 404  # nothing outside the root


def test_episode_list_filters_sorts_and_pages(client):
    page = client.get("/api/runs/out/episodes", params={"split": "train", "step": 1, "page_size": 4}).json()
    assert page["total"] == 6 and len(page["items"]) == 4
    second = client.get("/api/runs/out/episodes",
                        params={"split": "train", "step": 1, "page_size": 4, "page": 1}).json()
    assert len(second["items"]) == 2
    assert {e["idx"] for e in page["items"] + second["items"]} == set(range(6))
    ordered = client.get("/api/runs/out/episodes", params={"split": "train", "step": 1, "sort": "-reward"}).json()
    rewards = [e["reward"] for e in ordered["items"]]
    assert rewards == sorted(rewards, reverse=True)
    cut = rewards[2]
    high = client.get("/api/runs/out/episodes", params={"split": "train", "step": 1, "min_reward": cut}).json()
    assert all(e["reward"] >= cut for e in high["items"]) and high["total"] >= 3
    clean = client.get("/api/runs/out/episodes", params={"split": "train", "step": 1, "flag": "none"}).json()
    assert clean["total"] == 6 - sum(1 for e in ordered["items"] if e["flags"])
    assert client.get("/api/runs/out/episodes", params={"sort": "bogus"}).status_code == 400


def test_one_episode_has_turns_and_tokens(client):
    first = client.get("/api/runs/out/episodes", params={"split": "train", "step": 2}).json()["items"][0]
    ep = client.get(f"/api/runs/out/episodes/{first['id']}").json()
    assert len(ep["calls"]) == 2
    call0, call1 = ep["calls"]
    assert [m["role"] for m in call0["messages"]] == ["system", "user", "assistant"]
    assert call0["messages"][-1]["_reply"]
    # The second call extended the first: it stores only what was new (the follow-up), then its answer.
    assert [m["role"] for m in call1["messages"]] == ["user", "assistant"]
    assert call1["tokens"]["mask"] == [1] * len(call1["tokens"]["ids"])
    assert call1["tokens"]["advantage"] == pytest.approx(ep["advantage"])
    assert client.get("/api/runs/out/episodes/999999").status_code == 404


def test_a_run_killed_mid_step_still_opens(recorded_run, tmp_path):
    from starlette.testclient import TestClient

    copy = tmp_path / "killed"
    shutil.copytree(recorded_run, copy)
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/rew')  # the line a kill cut
    with TestClient(build_app(copy)) as c:
        assert {r["step"] for r in c.get("/api/runs/killed/metrics").json()["rows"]} == {1, 2}
        assert c.get("/api/runs/killed/steps").json()["steps"]
    assert list(find_runs(tmp_path)) == ["killed"]


def test_astuner_logview_serves_a_finished_run_and_refuses_an_empty_folder(recorded_run, tmp_path):
    assert main(["logview", str(tmp_path)]) == 2  # no run there
    proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "logview", str(recorded_run.parent)],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = line.split("log viewer at ", 1)[1].split()[0]
        runs = json.load(urllib.request.urlopen(url + "api/runs", timeout=10))
        assert runs["runs"][0]["id"] == "out"
        assert b"astuner log viewer" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_with_logview_serves_the_run_while_it_trains(tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir)
    assert main(["--conf", str(yaml), "--with-logview", "astuner.trainer_common.total_training_steps=1"]) == 0
    err = capsys.readouterr().err
    assert "log viewer at http://127.0.0.1:" in err and "astuner logview" in err
    assert (tmp_path / "out" / FILE_NAME).is_file()


# --- a real browser -------------------------------------------------------------------------------------------


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        message = ("the browser test needs Debian's chromium and chromium-driver packages "
                   "(scripts/setup_env.sh installs them as root: apt-get install chromium chromium-driver)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.slow
def test_pages_in_headless_chromium(recorded_run):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from astuner.logview.app import LogViewServer

    server = LogViewServer(recorded_run.parent)
    url = server.start()
    browser = _browser()
    wait = WebDriverWait(browser, 20)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        browser.get(url)
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#runs-table a"))).click()
        # The run page: curves from metrics.jsonl (with validation) and the steps table.
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#chart-reward polyline")))
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-accuracy polyline")
        browser.save_screenshot(str(ARTIFACTS / "logview_run.png"))
        browser.find_element(By.LINK_TEXT, "step 2").click()
        rows = wait.until(EC.presence_of_all_elements_located((By.CSS_SELECTOR, "#episodes-table tr td a")))
        assert len(rows) == 6
        rows[0].click()
        tokens = wait.until(EC.presence_of_all_elements_located((By.CSS_SELECTOR, "#token-view .tok")))
        assert len(tokens) > 4
        Select(browser.find_element(By.ID, "color-mode")).select_by_value("diff")
        token = wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#token-view .tok")))
        ActionChains(browser).move_to_element(token).perform()
        hover = wait.until(EC.visibility_of_element_located((By.ID, "hover")))
        assert "token id" in hover.text and "trainer" in hover.text
        browser.save_screenshot(str(ARTIFACTS / "logview_token_view.png"))
        assert (ARTIFACTS / "logview_token_view.png").stat().st_size > 10_000
    finally:
        browser.quit()
        server.stop()


@pytest.mark.slow
def test_a_compacted_episode_shows_its_segments_linked_in_headless_chromium(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait
    from test_context_policy import compacted_episode

    from astuner.logview import store
    from astuner.logview.app import LogViewServer
    from astuner.logview.records import episode_records

    (tmp_path / "run").mkdir()
    writer = store.StepWriter(tmp_path / "run")
    writer.write("train", 1, episode_records([compacted_episode()], None, None))
    writer.close()
    server = LogViewServer(tmp_path)
    url = server.start()
    browser = _browser()
    try:
        browser.get(url + "#/run/run/episode/1")
        segments = WebDriverWait(browser, 20).until(EC.presence_of_all_elements_located((By.CSS_SELECTOR, ".segment")))
        assert [s.text for s in segments] == ["agent reader, segment 1 starts: compacted by call 1",
                                              "agent reader, segment 2 starts: compacted by call 4"]
        summary = browser.find_element(By.ID, "call-1")
        assert "its work is first shown in call 2" in summary.text
        link = summary.find_element(By.CSS_SELECTOR, "[data-goto]")
        link.click()  # scrolls to the call, stays on the page
        assert browser.current_url.endswith("#/run/run/episode/1") and browser.find_element(By.ID, "call-2")
        assert "shown the work of call 4" in browser.find_element(By.ID, "call-5").text
    finally:
        browser.quit()
        server.stop()
