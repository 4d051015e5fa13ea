"""The quick-start workflow: one model call per episode through ModelTuner's chat API (no agent framework)."""

from astuner import ModelTuner, Workflow, WorkflowOutput, WorkflowTask


class AdditionWorkflow(Workflow):
    name = "addition"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        # reward=None: the judge named in the YAML scores metadata["final_answer"].
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
