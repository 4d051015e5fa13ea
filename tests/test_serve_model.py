"""`astuner serve-model` (astuner/serve/model_server.py): a checkpoint served over the OpenAI, Responses and
Anthropic APIs as training sampled it. A harness of its own (reasoning-gym's dataset and scorer, the openai and
anthropic SDKs) pointed at it gets, greedy, exactly the replies and scores `astuner eval` got; keys and temperature
rules checked apart."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from astuner.cli import main
from astuner.serve.model_server import ServedModel, episode_temperature, requested_temperature
from conftest import REPO

YAML = REPO / "tutorial" / "reasoning_gym" / "reasoning_gym.yaml"
START_TIMEOUT_S = 180


def test_temperature_zero_is_greedy_a_positive_one_is_used_and_none_is_the_runs():
    assert requested_temperature(b'{"temperature": 0}') == 0.0
    assert requested_temperature(b'{"temperature": 0.3}') == 0.3
    assert requested_temperature(b'{"messages": []}') is None
    assert requested_temperature(b'{"temperature": true}') is None and requested_temperature(b"not json") is None
    assert episode_temperature(0.0, 0.7) == 0.0  # a greedy episode: the gateway then ignores the request's
    assert episode_temperature(None, 0.7) == 0.7  # the run's
    assert episode_temperature(0.3, 0.7) == 0.7  # the gateway takes the request's 0.3 over the episode's 0.7


class _Runner:
    """What ServedModel reads of a RolloutRunner, for the key check (no request gets past it here)."""

    class gateway:  # noqa: N801 - stands in for the Gateway object
        @staticmethod
        async def app(scope, receive, send):
            raise AssertionError("a refused request must not reach the gateway")

    @staticmethod
    def new_tuner(*args):
        class Tuner:
            model_name = "astuner/tiny"
        return Tuner()


def test_a_wrong_or_missing_key_is_refused_in_each_apis_shape():
    app = ServedModel(_Runner(), 0.7, key="secret")

    async def ask(path: str, headers: list) -> tuple[int, dict]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    status, body = asyncio.run(ask("/v1/chat/completions", [(b"authorization", b"Bearer nope")]))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = asyncio.run(ask("/v1/messages", []))
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, _ = asyncio.run(ask("/v1/models", [(b"x-api-key", "clé".encode("latin-1"))]))  # not ASCII: still a 401
    assert status == 401


def test_serve_model_refuses_an_open_port_without_a_key(capsys):
    assert main(["serve-model", "--conf", str(YAML), "--host", "0.0.0.0"]) == 2
    assert "needs a key (--key-env VAR)" in capsys.readouterr().err
    os.environ.pop("ASTUNER_TEST_NO_SUCH_KEY", None)
    assert main(["serve-model", "--conf", str(YAML), "--key-env", "ASTUNER_TEST_NO_SUCH_KEY"]) == 2


def _start(args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "serve-model", *args], stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    deadline, seen = time.monotonic() + START_TIMEOUT_S, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "serving " in line and " at http" in line:
            return proc, line.split(" at ")[1].split(" ")[0]
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"serve-model did not start within {START_TIMEOUT_S}s: {''.join(seen)}")


@pytest.mark.slow
def test_a_harness_through_serve_model_gets_exactly_what_astuner_eval_got(tmp_path, tiny_model_dir):
    import anthropic
    import openai
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    from astuner.task_reader.base import VALIDATION_SEED_OFFSET
    from astuner.task_reader.reasoning_gym_reader import extract

    n = 6
    overrides = [f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf", "astuner.rollout.max_env_worker=1",
                 f"astuner.task_reader.reasoning_gym.validation_size={n}", f"astuner.experiment_dir={tmp_path / 'run'}",
                 "astuner.seed=3"]
    # 1. astuner eval: greedy episodes through the rollout
    assert main(["eval", "--conf", str(YAML), "--num-repeat", "0", "--out", str(tmp_path / "eval"), *overrides]) == 0
    with open(tmp_path / "eval" / "eval_tasks.csv") as f:
        eval_rewards = {r["task_id"]: float(r["greedy_reward"]) for r in csv.DictReader(f)}
    store = sqlite3.connect(next((tmp_path / "eval" / "episodes").glob("*/logview.sqlite")))
    eval_replies = dict(store.execute("SELECT e.task_id, c.response_text FROM episodes e JOIN calls c "
                                      "ON c.episode_id = e.id WHERE e.split = 'greedy'").fetchall())
    assert len(eval_replies) == n and any(eval_replies.values())

    # 2. the served checkpoint, and reasoning-gym's own loop over its own dataset, as its README writes it
    env = {**os.environ, "SERVE_KEY": "k-123"}
    proc, base_url = _start(["--conf", str(YAML), "--model", str(tiny_model_dir), "--port", "0",
                             "--key-env", "SERVE_KEY", *overrides], env)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="k-123", max_retries=0, timeout=120)
        data = CompositeDataset(CompositeConfig(size=n, seed=3 + VALIDATION_SEED_OFFSET, datasets=[DatasetSpec(
            "chain_sum", 1.0, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})]))
        replies, rewards = {}, {}
        for i, entry in enumerate(data):
            answer = client.chat.completions.create(
                model=client.models.list().data[0].id, temperature=0, max_tokens=48,
                messages=[{"role": "user", "content": entry["question"]}]).choices[0].message.content
            replies[f"validation-{i}"] = answer
            rewards[f"validation-{i}"] = data.score_answer(extract(answer, "last_number", "answer"), entry)
        assert replies == eval_replies  # token for token
        assert rewards == eval_rewards

        # the Responses and Messages APIs answer the same at temperature 0
        question = data[0]["question"]
        via_responses = client.responses.create(model="any", input=question, temperature=0, max_output_tokens=48)
        assert via_responses.output_text == eval_replies["validation-0"]
        messages = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="k-123", max_retries=0)
        via_messages = messages.messages.create(model="any", max_tokens=48, extra_body={"temperature": 0},
                                                messages=[{"role": "user", "content": question}])
        assert via_messages.content[0].text == eval_replies["validation-0"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
