"""The lookup agent on the OpenAI SDK: an ordinary tool-calling loop on `openai.AsyncOpenAI`.

The one astuner-specific line is where the client comes from: `model_tuner.get_openai_client()` (served
in-process; every call is recorded with its exact token ids). Deployed, the same `answer()` takes
`openai.AsyncOpenAI(base_url=..., api_key=...)`.
"""

import json

from astuner import Workflow, WorkflowOutput
from lookup_task import MAX_TURNS, SYSTEM, TOOL_SCHEMAS, TOOLS


async def answer(client, question: str, system: str = SYSTEM, tools: dict = TOOLS, max_turns: int = MAX_TURNS) -> str:
    """The agent's tool loop: ask, run the tools it calls, until it answers (or `max_turns` calls)."""
    schemas = [s for s in TOOL_SCHEMAS if s["function"]["name"] in tools]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            tool = tools.get(call.function.name)
            try:
                result = tool(**json.loads(call.function.arguments or "{}")) if tool else \
                    f"Error: no tool named {call.function.name!r}; the tools are {', '.join(tools)}."
            except (TypeError, ValueError) as error:  # arguments the tool does not take: the agent reads why
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""


class OpenAILookupAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        final = await answer(model_tuner.get_openai_client(), workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": final})
