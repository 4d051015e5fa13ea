"""A smolagents `ToolCallingAgent` on `OpenAIServerModel`, trained unchanged.

The only astuner-specific lines are `api_base` and `api_key`. smolagents is synchronous, so the agent runs in a
worker thread and reaches astuner's loopback endpoint over HTTP. It answers through its own `final_answer` tool
and asks for `tool_choice="required"`, which astuner checks (a plain-text answer is flagged `wrong_toolcall`).
"""

import asyncio

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

import code_table
from astuner import Workflow, WorkflowOutput


@tool
def lookup_code(name: str) -> str:
    """The access code of a person, by full name.

    Args:
        name: the person's full name.
    """
    return code_table.lookup_code(name)


class SmolagentsCodeAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        model = OpenAIServerModel(model_id="policy", api_base=model_tuner.base_url, api_key=model_tuner.api_key,
                                  client_kwargs={"max_retries": 0})
        agent = ToolCallingAgent(tools=[lookup_code], model=model, max_steps=3, verbosity_level=0,
                                 instructions=code_table.SYSTEM)
        answer = await asyncio.to_thread(agent.run, workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": str(answer)})
