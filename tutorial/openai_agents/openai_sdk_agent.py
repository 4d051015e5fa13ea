"""The math agent written against the OpenAI SDK: an ordinary tool-calling loop on `openai.AsyncOpenAI`.

The only astuner-specific line is where the client comes from: `model_tuner.get_openai_client()` (served
in-process; every call is recorded with its exact token ids). In deployment the same code takes
`openai.AsyncOpenAI(base_url=..., api_key=...)`.
"""

import json

from astuner import Workflow, WorkflowOutput
from astuner.tools import PYTHON_TOOL_SCHEMA, python_tool_text

SYSTEM = ("Solve the math problem. You can run Python with the execute_python_code tool. Give the final answer "
          "within \\boxed{}.")
MAX_TURNS = 3


async def solve(client, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[PYTHON_TOOL_SCHEMA], temperature=1.0)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            code = json.loads(call.function.arguments or "{}").get("code", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await python_tool_text(code)})
    return messages[-1].get("content") or ""


class OpenAIMathWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        answer = await solve(model_tuner.get_openai_client(), workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": answer})
