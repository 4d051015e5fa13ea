"""Two AgentScope patterns that train unchanged.

1. `OpenAIChatModel` with its `client` replaced by the episode's `openai.AsyncOpenAI` (the pattern of
   Trinity-RFT's ReAct tutorial): the agent keeps its OpenAI model class and formatter.
2. A function-style agent that takes `model` and calls it the way it calls `OpenAIChatModel`
   (`await model(messages, tools=...)` returning a ChatResponse); here it is handed `model_tuner` itself.

stream=False: AgentScope 1.0.21's streaming reader tests `"data" in delta.audio`, which raises with openai>=3
(its ChunkDelta always has `audio`, None for text); non-streaming calls are unaffected.
"""

from agentscope.agent import ReActAgent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.memory import InMemoryMemory
from agentscope.message import Msg
from agentscope.model import OpenAIChatModel
from agentscope.tool import Toolkit

from astuner import Workflow, WorkflowOutput
from astuner.tools import execute_python_code

SYSTEM = ("Solve the math problem. You can run Python with the execute_python_code tool. Give the final answer "
          "within \\boxed{}.")


class AgentScopeOpenAIClientWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        model = OpenAIChatModel(model_name="policy", api_key="unused", stream=False)
        model.client = model_tuner.get_openai_client()
        toolkit = Toolkit()
        toolkit.register_tool_function(execute_python_code)
        agent = ReActAgent(name="solver", sys_prompt=SYSTEM, model=model, formatter=OpenAIChatFormatter(),
                           toolkit=toolkit, memory=InMemoryMemory(), max_iters=2)
        agent.set_console_output_enabled(False)
        reply = await agent(Msg("user", workflow_task.task.main_query, role="user"))
        return WorkflowOutput(reward=None, metadata={"final_answer": reply.get_text_content() or ""})


async def function_agent(model, question: str) -> str:
    """An agent written as a function over an OpenAIChatModel-like `model`."""
    formatter = OpenAIChatFormatter()
    messages = await formatter.format([Msg("system", SYSTEM, "system"), Msg("user", question, "user")])
    response = await model(messages)
    return "".join(block.get("text", "") for block in response.content if block.get("type") == "text")


class FunctionAgentWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        answer = await function_agent(model_tuner, workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": answer})
