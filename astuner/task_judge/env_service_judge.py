"""EnvServiceJudge: the environment service scores the episode (`POST /instances/{id}/evaluate`).

The workflow leaves the instance open and returns `WorkflowOutput(reward=None,
metadata={"instance_id": ...})`; the judge evaluates it, then releases it (also when evaluation fails). Its
`metrics` land in the episode's output metadata under "env_metrics".
"""

from __future__ import annotations

from astuner.errors import UserError
from astuner.task_judge.base_judge import BaseJudge
from astuner.workflow import WorkflowOutput, WorkflowTask


class EnvServiceJudge(BaseJudge):
    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        from astuner.env_service import client_for

        instance_id = (workflow_output.metadata or {}).get("instance_id")
        if not instance_id:
            raise UserError(
                "EnvServiceJudge needs the environment instance: return WorkflowOutput(reward=None, "
                "metadata={'instance_id': ...}) from the workflow, and leave the instance for the judge to release."
            )
        client = client_for(workflow_task.task)
        try:
            result = await client.evaluate(instance_id)
        finally:
            await client.release(instance_id)
        workflow_output.metadata["env_metrics"] = result.get("metrics", {})
        return float(result.get("reward", 0.0)), bool(result.get("success", False))
