"""A ReAct math agent with a Python tool (AgentScope 1.x), trained by astuner.

The agent code is ordinary AgentScope: the only change from a deployed agent is `model=model_tuner`.
"""

from agentscope.agent import ReActAgent
from agentscope.formatter import DashScopeChatFormatter
from agentscope.memory import InMemoryMemory
from agentscope.message import Msg
from agentscope.tool import Toolkit

from astuner import ModelTuner, Workflow, WorkflowOutput, WorkflowTask
from astuner.tools import execute_python_code

SYSTEM_PROMPT = (
    "You are an agent specialized in solving math problems with tools. Solve the math problem given to you. "
    "You can write and execute Python code to perform calculations or check your answer. "
    "Give your final answer within \\boxed{}."
)


class MathAgentWorkflow(Workflow):
    name = "math_agent_workflow"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        toolkit = Toolkit()
        # astuner's execute_python_code runs the code in a subprocess with a timeout, a memory limit and a
        # scratch folder; agentscope.tool.execute_python_code works here too.
        toolkit.register_tool_function(execute_python_code)
        agent = ReActAgent(
            name="math_react_agent",
            sys_prompt=SYSTEM_PROMPT,
            model=model_tuner,
            formatter=DashScopeChatFormatter(),
            toolkit=toolkit,
            memory=InMemoryMemory(),
            max_iters=2,
        )
        agent.set_console_output_enabled(False)
        reply = await agent.reply(Msg("user", workflow_task.task.main_query, role="user"))
        # reward=None: the judge (task_judge.judge_protocol) compares final_answer with the dataset's answer.
        return WorkflowOutput(reward=None, metadata={"final_answer": reply.get_text_content() or ""})
