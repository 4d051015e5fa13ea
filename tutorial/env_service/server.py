"""A small environment service speaking astuner's env-service protocol (astuner/env_service.py).

The environment: an arithmetic question, a `calculate` tool, and a final answer. Run it with
    python tutorial/env_service/server.py --port 8765
and train against it with tutorial/env_service/env_service.yaml. Instances nobody releases expire after
INSTANCE_TTL_S seconds (an episode that crashed cannot release its own).
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import re
import threading
import time
import uuid

INSTANCE_TTL_S = 900.0
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


def build_app(env: ArithmeticEnv | None = None):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    env = env or ArithmeticEnv()

    def fail(status: int, message: str):
        return JSONResponse({"error": message}, status)

    async def list_tasks(request):
        split = request.query_params.get("split", "train")
        if split not in env.tasks:
            return fail(404, f"no split {split!r}; splits: {', '.join(env.tasks)}")
        return JSONResponse({"tasks": list(env.tasks[split].values())})

    async def create(request):
        env.expire()
        body = await request.json()
        task = env.task(str(body.get("task_id")))
        if task is None:
            return fail(404, f"unknown task_id {body.get('task_id')!r}")
        instance_id = uuid.uuid4().hex
        with env.lock:
            env.instances[instance_id] = {"task": task, "answer": None, "done": False, "created": time.monotonic()}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["query"]}]
        return JSONResponse({"instance_id": instance_id, "messages": messages, "tools": TOOLS})

    def instance(request):
        return env.instances.get(request.path_params["instance_id"])

    async def step(request):
        inst = instance(request)
        if inst is None:
            return fail(404, "unknown or expired instance")
        action = (await request.json()).get("action") or {}
        calls = action.get("tool_calls") or []
        if not calls:
            inst["answer"], inst["done"] = action.get("content") or "", True
            return JSONResponse({"messages": [], "done": True, "reward": None})
        replies = []
        for call in calls:
            function = call.get("function", {})
            try:
                import json

                args = json.loads(function.get("arguments") or "{}")
            except ValueError:
                args = {}
            result = calculate(args.get("expression", "")) if function.get("name") == "calculate" else (
                f"error: unknown tool {function.get('name')!r}")
            replies.append({"role": "tool", "tool_call_id": call.get("id"), "name": function.get("name"),
                            "content": result})
        return JSONResponse({"messages": replies, "done": False, "reward": None})

    async def evaluate(request):
        inst = instance(request)
        if inst is None:
            return fail(404, "unknown or expired instance")
        boxed = re.findall(r"\\boxed\{\s*(-?[\d.]+)\s*\}", inst["answer"] or "")
        success = bool(boxed) and float(boxed[-1]) == float(inst["task"]["answer"])
        return JSONResponse({"reward": 1.0 if success else 0.0, "success": success,
                             "metrics": {"answered": float(inst["done"])}})

    async def release(request):
        with env.lock:
            env.instances.pop(request.path_params["instance_id"], None)
        return JSONResponse({})

    return Starlette(routes=[
        Route("/tasks", list_tasks, methods=["GET"]),
        Route("/instances", create, methods=["POST"]),
        Route("/instances/{instance_id}/step", step, methods=["POST"]),
        Route("/instances/{instance_id}/evaluate", evaluate, methods=["POST"]),
        Route("/instances/{instance_id}", release, methods=["DELETE"]),
    ])


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    uvicorn.run(build_app(), host=args.host, port=args.port, log_level="warning")
