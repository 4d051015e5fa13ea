"""The lookup agent on the OpenAI SDK: an ordinary tool-calling loop on `openai.AsyncOpenAI`.

The one astuner-specific line is where the client comes from: `model_tuner.get_openai_client()` (served
in-process; every call is recorded with its exact token ids). Deployed, the same `answer()` takes
`openai.AsyncOpenAI(base_url=..., api_key=...)`.
"""

from astuner import Workflow, WorkflowOutput
from lookup_agent import answer


class OpenAILookupAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        final = await answer(model_tuner.get_openai_client(), workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": final})
