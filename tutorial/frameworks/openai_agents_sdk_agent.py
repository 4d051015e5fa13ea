"""An OpenAI Agents SDK agent (`Agent` + `Runner.run` on `OpenAIChatCompletionsModel`), trained unchanged.

The only astuner-specific line is the `AsyncOpenAI` client's `base_url` and `api_key`. Tracing is off: it
would upload every run to OpenAI's tracing service.
"""

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

import code_table
from astuner import Workflow, WorkflowOutput


@function_tool
def lookup_code(name: str) -> str:
    """The access code of a person, by full name."""
    return code_table.lookup_code(name)


class OpenAIAgentsCodeAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=model_tuner.base_url, api_key=model_tuner.api_key, max_retries=0)
        agent = Agent(name="codes", instructions=code_table.SYSTEM, tools=[lookup_code],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        result = await Runner.run(agent, workflow_task.task.main_query, max_turns=4)
        return WorkflowOutput(reward=None, metadata={"final_answer": str(result.final_output)})
