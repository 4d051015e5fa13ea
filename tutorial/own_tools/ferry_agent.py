"""The ferry agent: an ordinary tool-calling loop on the OpenAI SDK, as a user would write it first.

The astuner-specific line is where the client comes from: `model_tuner.get_openai_client()`.
"""

import json

from astuner import Workflow, WorkflowOutput
from ferry_task import MAX_TURNS, SYSTEM, TOOL_SCHEMAS, TOOLS


def call_tool(name: str, arguments: str) -> str:
    tool = TOOLS.get(name)
    if tool is None:
        return f"Error: no tool named {name!r}; the tools are {', '.join(TOOLS)}."
    try:
        return tool(**json.loads(arguments or "{}"))
    except (TypeError, ValueError) as error:  # a missing or unknown argument: the agent reads why
        return f"Error: {error}"


class FerryAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        client = model_tuner.get_openai_client()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": workflow_task.task.main_query}]
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOL_SCHEMAS)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": call_tool(call.function.name, call.function.arguments)})
        final = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
        return WorkflowOutput(reward=None, metadata={"final_answer": final})
