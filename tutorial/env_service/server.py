"""A small environment service speaking astuner's env-service protocol (astuner/env_service.py).

The environment: an arithmetic question, a `calculate` tool, and a final answer. Run it with
    python tutorial/env_service/server.py --port 8765
and train against it with tutorial/env_service/env_service.yaml. Instances nobody releases expire after
INSTANCE_TTL_S seconds (an episode that crashed cannot release its own).

It honours idempotency keys (the protocol in astuner/env_service.py): a POST carrying `Idempotency-Key` that it
has already answered, or is still answering, gets that first answer again (header `Idempotent-Replayed: true`)
instead of creating a second instance or applying the step twice. The last REPLAY_CACHE_SIZE answers are kept.
Every response says `Idempotency-Key-Honoured: true`, which is what lets the client retry its POSTs.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import operator
import random
import re
import threading
import time
import uuid
from collections import OrderedDict

INSTANCE_TTL_S = 900.0
REPLAY_CACHE_SIZE = 10_000
SYSTEM = ("Solve the arithmetic question. You may call the calculate tool. End with the final answer as "
          "\\boxed{number}.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def make_tasks(split: str, n: int = 64) -> list[dict]:
    rng = random.Random(f"arith-{split}")
    tasks = []
    for i in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
        tasks.append({"task_id": f"{split}-{i}", "query": f"What is {a} * {c} + {b}?", "answer": a * c + b})
    return tasks


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ( ) are allowed")

    try:
        result = value(ast.parse(str(expression), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result) if float(result).is_integer() else result)


class ArithmeticEnv:
    """The environment's state and rules, apart from HTTP. The actions are coroutines, as a real environment's
    would be (a sandbox, a browser). Each changes state only as its last act, so one that raised applied nothing."""

    def __init__(self) -> None:
        self.tasks = {split: {t["task_id"]: t for t in make_tasks(split)} for split in ("train", "test")}
        self.instances: dict[str, dict] = {}
        self.lock = threading.Lock()

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for key in [k for k, v in self.instances.items() if now - v["created"] > INSTANCE_TTL_S]:
                del self.instances[key]

    def task(self, task_id: str) -> dict | None:
        for tasks in self.tasks.values():
            if task_id in tasks:
                return tasks[task_id]
        return None

    async def create(self, task: dict) -> dict:
        self.expire()
        instance_id = uuid.uuid4().hex
        with self.lock:
            self.instances[instance_id] = {"task": task, "answer": None, "done": False, "steps": 0,
                                           "created": time.monotonic()}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["query"]}]
        return {"instance_id": instance_id, "messages": messages, "tools": TOOLS}

    async def step(self, inst: dict, action: dict) -> dict:
        calls = action.get("tool_calls") or []
        if not calls:
            inst["answer"], inst["done"], inst["steps"] = action.get("content") or "", True, inst["steps"] + 1
            return {"messages": [], "done": True, "reward": None}
        replies = []
        for call in calls:
            function = call.get("function", {})
            try:
                args = json.loads(function.get("arguments") or "{}")
            except ValueError:
                args = {}
            result = calculate(args.get("expression", "")) if function.get("name") == "calculate" else (
                f"error: unknown tool {function.get('name')!r}")
            replies.append({"role": "tool", "tool_call_id": call.get("id"), "name": function.get("name"),
                            "content": result})
        inst["steps"] += 1
        return {"messages": replies, "done": False, "reward": None}

    async def evaluate(self, inst: dict) -> dict:
        boxed = re.findall(r"\\boxed\{\s*(-?[\d.]+)\s*\}", inst["answer"] or "")
        success = bool(boxed) and float(boxed[-1]) == float(inst["task"]["answer"])
        return {"reward": 1.0 if success else 0.0, "success": success,
                "metrics": {"answered": float(inst["done"]), "steps": float(inst["steps"])}}


class Replays:
    """The answers to keyed requests, so that a retry is answered, not applied again. Keyed by method, path and
    Idempotency-Key; a request still being answered is waited for. Bounded: the oldest answers are dropped first.
    A handler that raised is not remembered (it applied nothing, see ArithmeticEnv), so its retry runs again."""

    def __init__(self, size: int = REPLAY_CACHE_SIZE) -> None:
        self.size = size
        self.answers: OrderedDict[str, tuple[str, int, bytes]] = OrderedDict()
        self.running: dict[str, asyncio.Future] = {}

    def idempotent(self, handler):
        from starlette.responses import JSONResponse, Response

        async def keyed(request):
            key = request.headers.get("idempotency-key")
            if not key:
                return await handler(request)
            slot = f"{request.method} {request.url.path} {key}"
            fingerprint = hashlib.sha256(await request.body()).hexdigest()
            while slot in self.running:  # the first attempt is still running (its client gave up waiting)
                await asyncio.wait({self.running[slot]})
            if slot in self.answers:
                seen, status, body = self.answers[slot]
                if seen != fingerprint:
                    return JSONResponse({"error": "Idempotency-Key reused for a different request"}, 422)
                return Response(body, status, media_type="application/json", headers={"Idempotent-Replayed": "true"})
            self.running[slot] = asyncio.get_running_loop().create_future()
            try:
                response = await handler(request)
                self.answers[slot] = (fingerprint, response.status_code, response.body)
                while len(self.answers) > self.size:
                    self.answers.popitem(last=False)
                return response
            finally:
                self.running.pop(slot).set_result(None)

        return keyed


def honours_keys(app):
    """The ASGI app with `Idempotency-Key-Honoured: true` on every response."""

    async def wrapped(scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"idempotency-key-honoured", b"true")]}
            await send(message)

        await app(scope, receive, send_with_header)

    return wrapped


def build_app(env: ArithmeticEnv | None = None, replays: Replays | None = None):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    env = env or ArithmeticEnv()
    replays = replays or Replays()

    def fail(status: int, message: str):
        return JSONResponse({"error": message}, status)

    async def list_tasks(request):
        split = request.query_params.get("split", "train")
        if split not in env.tasks:
            return fail(404, f"no split {split!r}; splits: {', '.join(env.tasks)}")
        return JSONResponse({"tasks": list(env.tasks[split].values())})

    async def create(request):
        body = await request.json()
        task = env.task(str(body.get("task_id")))
        if task is None:
            return fail(404, f"unknown task_id {body.get('task_id')!r}")
        return JSONResponse(await env.create(task))

    def instance(request):
        return env.instances.get(request.path_params["instance_id"])

    async def step(request):
        inst = instance(request)
        if inst is None:
            return fail(404, "unknown or expired instance")
        return JSONResponse(await env.step(inst, (await request.json()).get("action") or {}))

    async def evaluate(request):
        inst = instance(request)
        if inst is None:
            return fail(404, "unknown or expired instance")
        return JSONResponse(await env.evaluate(inst))

    async def release(request):
        with env.lock:
            env.instances.pop(request.path_params["instance_id"], None)
        return JSONResponse({})

    return honours_keys(Starlette(routes=[
        Route("/tasks", list_tasks, methods=["GET"]),
        Route("/instances", replays.idempotent(create), methods=["POST"]),
        Route("/instances/{instance_id}/step", replays.idempotent(step), methods=["POST"]),
        Route("/instances/{instance_id}/evaluate", replays.idempotent(evaluate), methods=["POST"]),
        Route("/instances/{instance_id}", release, methods=["DELETE"]),
    ]))


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    uvicorn.run(build_app(), host=args.host, port=args.port, log_level="warning")
