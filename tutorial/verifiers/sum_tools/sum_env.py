"""A verifiers (v1) environment with a tool, written with verifiers' own classes and nothing of astuner's: sums of
two numbers, the model asked to use an `add` tool and then to state the result.

The taskset (`SumTaskset`) yields the tasks; each task (`SumTask`) scores its trace with two rewards, `correct`
(the reply's last number is the sum; weight 1) and `used_tool` (weight 0: logged, not counted), and a metric,
`tool_calls`. The harness (`ToolLoopHarness`) is the agent program: an OpenAI chat loop with Python tools, run in
the rollout's process (verifiers' built-in harnesses are uv scripts fetched at their first start; this one needs
nothing but the model's endpoint). Exported beside the taskset, it is the taskset's default harness.
"""

from __future__ import annotations

import json
import random
import re

from openai import AsyncOpenAI

import verifiers.v1 as vf


def add(a: int, b: int) -> int:
    return a + b


ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


class ToolLoopConfig(vf.HarnessConfig):
    max_rounds: int = 4


class ToolLoopHarness(vf.Harness[ToolLoopConfig]):
    """Ask the model, run the tools it calls, give it their results; stop at a reply without a tool call."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    NEEDS_CONTAINER = False

    async def setup(self, runtime: vf.Runtime) -> None:
        return None

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None,
                     ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for _ in range(self.config.max_rounds):
                reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                              tools=[ADD_SCHEMA])).choices[0].message
                messages.append(reply.model_dump(exclude_none=True))
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    try:
                        result = str(add(**json.loads(call.function.arguments or "{}")))
                    except Exception as exc:  # noqa: BLE001 - a bad call's error is the model's to read
                        result = f"error: {type(exc).__name__}: {exc}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.0)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class SumConfig(vf.TasksetConfig):
    count: int = 300
    max_value: int = 9
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.count):
            a, b = rng.randint(1, self.config.max_value), rng.randint(1, self.config.max_value)
            yield SumTask(SumData(prompt=f"What is {a} + {b}? Use the add tool, then state the sum.", answer=a + b),
                          self.config.task)


__all__ = ["SumTaskset", "ToolLoopHarness"]
