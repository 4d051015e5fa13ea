"""The lookup agent as an AgentScope `ReActAgent` with a `Toolkit` (AgentScope 1.x), as the seeds' agents are.

The agent code is ordinary AgentScope: the only change from a deployed agent is `model=model_tuner`.
"""

from agentscope.agent import ReActAgent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.memory import InMemoryMemory
from agentscope.message import Msg, TextBlock
from agentscope.tool import Toolkit, ToolResponse

import lookup_task
from astuner import ModelTuner, Workflow, WorkflowOutput, WorkflowTask


def find_badge(name: str) -> ToolResponse:
    """The badge number of a person, by full name.

    Args:
        name (str): The person's full name.
    """
    return ToolResponse(content=[TextBlock(type="text", text=lookup_task.find_badge(name))])


def lookup_code(badge: str) -> ToolResponse:
    """The access code kept for a badge number.

    Args:
        badge (str): The badge number.
    """
    return ToolResponse(content=[TextBlock(type="text", text=lookup_task.lookup_code(badge))])


async def answer(model, question: str) -> str:
    toolkit = Toolkit()
    toolkit.register_tool_function(find_badge)
    toolkit.register_tool_function(lookup_code)
    agent = ReActAgent(name="codes", sys_prompt=lookup_task.SYSTEM, model=model, formatter=OpenAIChatFormatter(),
                       toolkit=toolkit, memory=InMemoryMemory(), max_iters=lookup_task.MAX_TURNS)
    agent.set_console_output_enabled(False)
    reply = await agent.reply(Msg("user", question, role="user"))
    return reply.get_text_content() or ""


class ReActLookupAgent(Workflow):
    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        final = await answer(model_tuner, workflow_task.task.main_query)
        # reward=None: the judge named in the YAML (lookup_task.CodeJudge) scores final_answer.
        return WorkflowOutput(reward=None, metadata={"final_answer": final})
