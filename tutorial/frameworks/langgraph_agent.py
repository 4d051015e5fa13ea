"""A LangGraph ReAct agent (`create_react_agent` over LangChain's `ChatOpenAI`), trained unchanged.

The only astuner-specific line is where `ChatOpenAI` points: `model_tuner.base_url` and `model_tuner.api_key`
(astuner's loopback OpenAI endpoint; every call is recorded with its exact token ids). `langchain_openai` caches
one HTTP client per base URL for the whole process, which works because astuner runs every step's episodes on
one event loop.
"""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

import code_table
from astuner import Workflow, WorkflowOutput


@tool
def lookup_code(name: str) -> str:
    """The access code of a person, by full name."""
    return code_table.lookup_code(name)


class LangGraphCodeAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        model = ChatOpenAI(model="policy", base_url=model_tuner.base_url, api_key=model_tuner.api_key,
                           max_retries=0)  # a retried call would be a second sampled call in the record
        agent = create_react_agent(model, [lookup_code], prompt=code_table.SYSTEM)
        result = await agent.ainvoke({"messages": [("user", workflow_task.task.main_query)]},
                                     config={"recursion_limit": 8})
        return WorkflowOutput(reward=None, metadata={"final_answer": result["messages"][-1].content})
