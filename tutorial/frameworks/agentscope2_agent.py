"""An AgentScope 2.x `Agent` with a `Toolkit`, trained unchanged (needs AgentScope 2.x: Python 3.11+, mcp>=2).

Two ways to give it the model, both recorded with exact token ids:
  - its own `OpenAIChatModel` with a credential pointed at astuner's loopback endpoint (this class: the agent code
    is what you deploy, only `base_url` and `api_key` differ);
  - `model_tuner.agentscope_model()`, the same model class served in-process (`run_agent` below, the function a
    `tune()` call or the YAML names: there `model` already is that model).
"""

from agentscope.agent import Agent, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import Msg, TextBlock
from agentscope.model import OpenAIChatModel
from agentscope.tool import FunctionTool, Toolkit

import code_table
from astuner import Workflow, WorkflowOutput


def lookup_code(name: str) -> str:
    """The access code of a person, by full name.

    Args:
        name (`str`):
            The person's full name.
    """
    return code_table.lookup_code(name)


async def answer(model, question: str) -> str:
    # is_read_only: AgentScope 2.x asks a user to confirm any other tool call, and a rollout has no user.
    toolkit = Toolkit(tools=[FunctionTool(lookup_code, is_read_only=True)])
    agent = Agent(name="codes", system_prompt=code_table.SYSTEM, model=model, toolkit=toolkit,
                  react_config=ReActConfig(max_iters=3))
    reply = await agent.reply(Msg(name="user", content=[TextBlock(text=question)], role="user"))
    return reply.get_text_content() or ""


class AgentScope2CodeAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        model = OpenAIChatModel(
            credential=OpenAICredential(api_key=model_tuner.api_key, base_url=model_tuner.base_url),
            model="policy", stream=False, max_retries=0)
        final = await answer(model, workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": final})


async def run_agent(task: dict, model, auxiliary_models) -> WorkflowOutput:
    """The tune() form: `model` is AgentScope 2.x's OpenAIChatModel, served by the episode."""
    return WorkflowOutput(reward=None, metadata={"final_answer": await answer(model, task["question"])})


async def run_named_agent(task: dict, model, auxiliary_models) -> WorkflowOutput:
    """With astuner.agents set (say {coder: {model: policy}}), a function workflow's `model` is {agent: that agent's
    OpenAIChatModel}, each served by the model astuner.agents names for it."""
    return WorkflowOutput(reward=None, metadata={"final_answer": await answer(model["coder"], task["question"])})
