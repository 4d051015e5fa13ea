"""A workflow that plays an environment service: the service sends the observation and the tools, the model
answers, each answer is a step, and EnvServiceJudge has the service score the episode."""

from __future__ import annotations

from astuner.env_service import client_for
from astuner.workflow import Workflow, WorkflowOutput

MAX_TURNS = 4


class EnvServiceWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        env = client_for(workflow_task.task)
        instance = await env.create(workflow_task.task.task_id)
        instance_id, messages, tools = instance["instance_id"], instance["messages"], instance["tools"]
        try:
            for _ in range(MAX_TURNS):
                reply = await model_tuner.chat(messages, tools)
                messages.append(reply)
                step = await env.step(instance_id, reply)
                messages.extend(step["messages"])  # the prompt grows: the next call reuses this one's token ids
                if step["done"]:
                    break
        except BaseException:
            await env.release(instance_id)  # nobody will judge it
            raise
        # Left open for EnvServiceJudge, which evaluates and then releases it.
        return WorkflowOutput(reward=None, metadata={"instance_id": instance_id})
