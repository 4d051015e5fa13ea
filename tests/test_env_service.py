"""The environment-service client, reader and judge against the tutorial's service (real HTTP, uvicorn)."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest
from conftest import load_tutorial_module, serve_in_thread
from test_model_tuner import make_tuner

from astuner.env_service import EnvServiceClient, EnvServiceError, client_for
from astuner.errors import UserError
from astuner.task_judge.env_service_judge import EnvServiceJudge
from astuner.task_reader.env_service_reader import EnvServiceTaskReader
from astuner.workflow import WorkflowOutput, WorkflowTask


def _reader(url, **extra):
    section = SimpleNamespace(env_url=url, env_type="arithmetic", training_split="train", validation_split="test",
                              request_timeout=5.0, retries=1, **extra)
    return EnvServiceTaskReader(SimpleNamespace(query_field="question", task_id_field=None, env_service=section), ".")


def test_reader_lists_tasks_with_a_link_to_the_service(env_server):
    url, _ = env_server
    reader = _reader(url)
    tasks, val = reader.training_tasks(), reader.validation_tasks()
    assert len(tasks) == 64 and len(val) == 64
    assert tasks[0].task_id == "train-0" and tasks[0].main_query.startswith("What is")
    assert tasks[0].metadata["env_service"]["env_url"] == url.rstrip("/")
    assert client_for(tasks[0]).env_type == "arithmetic"


def test_workflow_and_judge_play_the_service(env_server, demo_tokenizer):
    url, env = env_server
    workflow_cls = load_tutorial_module("tutorial/env_service/workflow.py", "tutorial_env_workflow").EnvServiceWorkflow
    task = _reader(url).training_tasks()[0]
    answer = task.metadata["answer"]
    expression = task.main_query.removeprefix("What is ").rstrip("?")
    tool_turn = f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    tuner, engine = make_tuner(demo_tokenizer, [tool_turn, f"The answer is \\boxed{{{answer}}}"])
    workflow_task = WorkflowTask(task, 0, "e0", False)

    async def episode():
        output = await workflow_cls().execute(workflow_task, tuner)
        assert len(env.instances) == 1  # left open for the judge
        return output, await EnvServiceJudge().compute_reward(workflow_task, output)

    output, (reward, success) = asyncio.run(episode())
    assert (reward, success) == (1.0, True)
    assert env.instances == {}  # released by the judge
    assert output.metadata["env_metrics"] == {"answered": 1.0, "steps": 2.0}
    first, second = tuner.calls
    assert f"<tool_response>\n{answer}\n</tool_response>" in demo_tokenizer.decode(second.prompt_ids)
    assert second.extends_previous  # the service's observation extended the conversation token-exactly


def test_a_service_that_is_down_is_a_clear_error_after_retries():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        _reader(f"http://127.0.0.1:{port}").training_tasks()
    message = str(info.value)
    assert "did not answer" in message and "2 attempts" in message and "env_url" in message
    assert time.monotonic() - start < 5  # one backoff of 0.5 s, no hang
    with pytest.raises(UserError, match="env_url is not set"):
        _reader(None)


def test_5xx_is_retried_and_4xx_is_reported():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    hits = {"n": 0}

    async def flaky(request):
        hits["n"] += 1
        if hits["n"] == 1:
            return JSONResponse({"error": "warming up"}, 503)
        return JSONResponse({"tasks": [{"task_id": "a", "query": "q"}]})

    async def missing(request):
        return JSONResponse({"error": "unknown task_id 'zzz'"}, 404)

    url, stop = serve_in_thread(Starlette(routes=[Route("/tasks", flaky), Route("/instances", missing,
                                                                                methods=["POST"])]))
    try:
        client = EnvServiceClient(url, request_timeout=5, retries=2, backoff_s=0.05)
        assert client.list_tasks("train") == [{"task_id": "a", "query": "q"}] and hits["n"] == 2
        with pytest.raises(EnvServiceError, match="404: unknown task_id 'zzz'"):
            asyncio.run(client.create("zzz"))
    finally:
        stop()


def test_judge_needs_the_instance_id():
    with pytest.raises(UserError, match="instance_id"):
        asyncio.run(EnvServiceJudge().compute_reward(SimpleNamespace(task=None), WorkflowOutput(reward=None)))


def _counting(app, seen: list):
    """The ASGI app, recording "METHOD path" of every request it receives."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            seen.append(f"{scope['method']} {scope['path']}")
        await app(scope, receive, send)

    return wrapped


@pytest.mark.slow
def test_a_create_and_a_step_answered_after_the_deadline_are_applied_once():
    module = load_tutorial_module("tutorial/env_service/server.py", "tutorial_env_server")

    class AnswersLate(module.ArithmeticEnv):
        """Applies each create and step, then answers the first of each after the client's deadline."""

        late = {"create", "step"}

        async def _late(self, what):
            if what in self.late:
                self.late.discard(what)
                await asyncio.sleep(0.8)

        async def create(self, task):
            answer = await super().create(task)
            await self._late("create")
            return answer

        async def step(self, inst, action):
            answer = await super().step(inst, action)
            await self._late("step")
            return answer

    env, requests = AnswersLate(), []
    url, stop = serve_in_thread(_counting(module.build_app(env), requests))
    try:
        client = EnvServiceClient(url, "arithmetic", request_timeout=0.4, retries=3, backoff_s=0.05)
        task = client.list_tasks("train")[0]  # as the reader does; the service says it honours keys

        async def play():
            instance = await client.create(task["task_id"])
            step = await client.step(instance["instance_id"], {"role": "assistant",
                                                               "content": f"\\boxed{{{task['answer']}}}"})
            return instance, step, await client.evaluate(instance["instance_id"])

        instance, step, result = asyncio.run(play())
    finally:
        stop()
    assert env.late == set()  # both were answered late ...
    assert requests.count("POST /instances") >= 2 and sum(r.endswith("/step") for r in requests) >= 2  # ... retried
    assert list(env.instances) == [instance["instance_id"]]  # one instance created
    assert step["done"] and result["metrics"]["steps"] == 1.0  # one step applied
    assert (result["reward"], result["success"]) == (1.0, True)


def test_the_tutorial_service_replays_a_keyed_post(env_server):
    import httpx

    url, env = env_server
    key = {"Idempotency-Key": "k1"}
    first = httpx.post(f"{url}/instances", json={"task_id": "train-0"}, headers=key)
    again = httpx.post(f"{url}/instances", json={"task_id": "train-0"}, headers=key)
    assert first.headers["Idempotency-Key-Honoured"] == "true" and "Idempotent-Replayed" not in first.headers
    assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"
    assert len(env.instances) == 1
    other = httpx.post(f"{url}/instances", json={"task_id": "train-1"}, headers=key)
    assert other.status_code == 422 and "different request" in other.json()["error"]
    assert len(httpx.post(f"{url}/instances", json={"task_id": "train-0"}).json()["instance_id"]) > 0  # no key
    assert len(env.instances) == 2


def test_a_post_is_not_retried_once_sent_to_a_service_that_does_not_honour_keys():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    applied = []

    async def step(request):
        applied.append(request.headers.get("Idempotency-Key"))
        await asyncio.sleep(0.6)  # applied, answered after the client's deadline
        return JSONResponse({"messages": [], "done": True, "reward": None})

    url, stop = serve_in_thread(Starlette(routes=[Route("/instances/{i}/step", step, methods=["POST"])]))
    try:
        client = EnvServiceClient(url, request_timeout=0.2, retries=2, backoff_s=0.05)
        with pytest.raises(EnvServiceError, match="not retried.*may have applied it"):
            asyncio.run(client.step("i", {"role": "assistant", "content": "x"}))
        time.sleep(0.5)  # a retry, had there been one, has arrived by now
    finally:
        stop()
    assert len(applied) == 1 and applied[0]  # one attempt, and it carried a key


def test_a_post_that_never_reached_the_service_is_retried():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here: connection refused
    client = EnvServiceClient(f"http://127.0.0.1:{port}", request_timeout=1, retries=2, backoff_s=0.01)
    with pytest.raises(EnvServiceError, match="did not answer .*ConnectError.* after 3 attempts"):
        asyncio.run(client.step("i", {"role": "assistant", "content": "x"}))


def test_the_clients_built_per_request_share_one_tls_context(env_server, monkeypatch):
    """httpx reads the whole CA bundle for each client it builds (~20 ms of CPU, more than a local request): the
    env-service client, which opens one per request, and an auxiliary endpoint's, one per call, share one."""
    import ssl

    from astuner.auxiliary import EndpointChatModel
    from astuner.http_body import tls_context

    built, real = [], ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    url, env = env_server
    client = EnvServiceClient(url, "arithmetic", 5.0, 0)
    endpoint = EndpointChatModel("critic", SimpleNamespace(base_url="https://models.example/v1", api_key_env=None,
                                                           timeout=5.0, model_name="m"), {})

    async def episodes(n):
        for task in client.list_tasks("train")[:n]:
            created = await client.create(task["task_id"])
            await client.release(created["instance_id"])

    tls_context.cache_clear()
    asyncio.run(episodes(1))  # imports done (aiohttp builds a context of its own once), the shared one built
    endpoint._client()
    assert len(built) >= 1
    built.clear()
    asyncio.run(episodes(3))
    assert endpoint._client()._client is not endpoint._client()._client  # a client per call, as episodes need
    assert built == [] and env.instances == {}
