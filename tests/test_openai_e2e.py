"""The OpenAI front ends end to end through the debug backbone (the CLI, the tiny random model): an agent using
the in-process client, the loopback endpoint with streaming and a wrong key, and each OpenAI-style tutorial."""

from __future__ import annotations

import json

import pytest
from test_run_contract import write_run

from astuner.cli import main
from conftest import REPO
from tolerances import LOGPROB_ATOL

HTTP_WORKFLOW = '''
import json, httpx
from astuner import Workflow, WorkflowOutput

class Mixed(Workflow):
    async def execute(self, workflow_task, model_tuner):
        client = model_tuner.get_openai_client()
        first = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": workflow_task.task.main_query}])
        text = first.choices[0].message.content
        url, key = model_tuner.base_url, model_tuner.api_key
        async with httpx.AsyncClient(timeout=60) as http:
            wrong = await http.post(f"{url}/chat/completions", headers={"Authorization": "Bearer nope"},
                                    json={"model": "p", "messages": [{"role": "user", "content": "x"}]})
            body = {"model": "p", "stream": True, "messages": [
                {"role": "user", "content": workflow_task.task.main_query},
                {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]}
            parts = []
            async with http.stream("POST", f"{url}/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        return WorkflowOutput(reward=None, metadata={"final_answer": "".join(parts), "wrong_key": wrong.status_code})
'''


def _trajectories(out, step=1):
    return [json.loads(line) for line in
            (out / "trajectories" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]


# Clients built once per process, as SDKs and users do (langchain_openai caches one httpx client per base URL):
# they bind their connections to the event loop of their first request, so every step's episodes must run on
# that same loop.
CACHED_CLIENTS_WORKFLOW = '''
import httpx, openai
from astuner import Workflow, WorkflowOutput

HTTP = httpx.AsyncClient(timeout=60)  # built at import time, before any event loop runs
OPENAI = {}  # base URL -> AsyncOpenAI, built once per process

class Cached(Workflow):
    async def execute(self, workflow_task, model_tuner):
        url, key = model_tuner.base_url, model_tuner.api_key
        client = OPENAI.setdefault(url, openai.AsyncOpenAI(base_url=url, api_key="set-per-call", max_retries=0))
        first = await client.with_options(api_key=key).chat.completions.create(
            model="p", messages=[{"role": "user", "content": workflow_task.task.main_query}])
        resp = await HTTP.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
            "model": "p", "messages": [{"role": "user", "content": workflow_task.task.main_query},
                                       {"role": "assistant", "content": first.choices[0].message.content},
                                       {"role": "user", "content": "Again."}]})
        resp.raise_for_status()
        return WorkflowOutput(reward=None, metadata={"final_answer": resp.json()["choices"][0]["message"]["content"]})
'''


@pytest.mark.slow
def test_clients_cached_across_steps_keep_working(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "cached.py").write_text(CACHED_CLIENTS_WORKFLOW)
    code = main(["--conf", str(yaml), "astuner.trainer_common.total_training_steps=3",
                 "astuner.rollout.agentscope_workflow='cached.py->Cached'"])
    assert code == 0
    for step in (1, 2, 3):
        episodes = _trajectories(tmp_path / "out", step)
        assert len(episodes) == 6 and all(len(e["calls"]) == 2 and not e["flags"] for e in episodes), (
            step, [e.get("error") for e in episodes])


@pytest.mark.slow
def test_client_and_endpoint_through_the_debug_backbone(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "mixed.py").write_text(HTTP_WORKFLOW)
    code = main(["--conf", str(yaml), "astuner.trainer_common.total_training_steps=1",
                 "astuner.rollout.agentscope_workflow='mixed.py->Mixed'",
                 "astuner.rollout.multi_turn.sample_mode=merge"])
    assert code == 0
    episodes = _trajectories(tmp_path / "out")
    assert len(episodes) == 6 and all(len(e["calls"]) == 2 for e in episodes)
    assert all(e["output_metadata"]["wrong_key"] == 401 for e in episodes)
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    # Each streamed second call extends the first token-exactly, so merge joins every second call.
    assert metrics["rollout/prefix_reuse_rate"] == pytest.approx(0.5)
    assert metrics["rollout/merge_ratio"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_abs_diff_mean"] < LOGPROB_ATOL
    assert 0 <= metrics["rollout/kl_engine_trainer_k3"] < LOGPROB_ATOL**2  # k3 ~ d^2/2: fp32 engine and trainer agree


@pytest.mark.parametrize("workflow", [
    "openai_sdk_agent.py->OpenAIMathWorkflow",
    "http_agent.py->HttpMathWorkflow",
    "agentscope_openai_client.py->AgentScopeOpenAIClientWorkflow",
    "agentscope_openai_client.py->FunctionAgentWorkflow",
])
@pytest.mark.slow
def test_openai_tutorials_run_one_step(tmp_path, tiny_model_dir, workflow):
    code = main(["--conf", str(REPO / "tutorial/openai_agents/openai_agents.yaml"),
                 f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf",
                 f"astuner.rollout.agentscope_workflow='{workflow}'", "astuner.data.train_batch_size=2",
                 "astuner.rollout.num_repeat=2", "astuner.rollout.max_response_length_in_one_turn=16",
                 "astuner.rollout.max_model_len=2048",
                 "astuner.trainer_common.total_training_steps=1", "astuner.rollout.compute_madness_checklist=[]"])
    assert code == 0
    episodes = _trajectories(tmp_path)
    assert len(episodes) == 4 and all(e["calls"] and not e["flags"] for e in episodes)
