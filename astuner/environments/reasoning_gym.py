"""reasoning-gym (https://github.com/open-thought/reasoning-gym): procedural datasets with their own scorers,
played unchanged.

    astuner:
      task_reader:
        type: reasoning_gym
        reasoning_gym:
          datasets:
            - {name: chain_sum, weight: 1.0, config: {min_terms: 2, max_terms: 2, max_digits: 1}}
          size: 1000             # training tasks
          validation_size: 64

The tasks are reasoning-gym's own `CompositeDataset` (its weighted mix, even of one dataset): training items
0..size-1 of the composite seeded `seed`, validation items of another composite of the same datasets seeded
`seed + VALIDATION_SEED_OFFSET`. A task keeps its recipe (composite spec and index), not the generated entry: the
judge rebuilds the composite (cached) and scores with `score_answer(answer, composite[index])`, the dataset's own
scorer on the very entry it generated, so nothing of an entry has to survive JSON or a trip between processes.

The workflow (`AnswerWorkflow`) is one model call: reasoning-gym's system prompt (`system_prompt`: one of its
`SYSTEM_PROMPTS` by name, or your text) and the question. The judge (`ReasoningGymJudge`) takes the answer inside
the last `<answer_tag>...</answer_tag>` of the reply (reasoning-gym's `extract_answer`; no tag: no answer, which
its scorers give 0; `answer_from: last_number` takes the reply's last number instead, for small models that
never write tags) and logs each dataset's score as `metrics/score/<dataset>`. A scorer that raises is the
environment's failure (astuner/environments/failures.py): the episode is flagged, kept out of its group and run
again, never scored 0. Either may be replaced by your
own (an agent with tools answering the same questions, say): the judge needs only the reply text in
`WorkflowOutput.metadata["final_answer"]` (or `response`).
"""

from __future__ import annotations

from astuner.environments import failures as env_failures
from astuner.errors import UserError
from astuner.model_tuner import ModelTuner
from astuner.task_judge.base_judge import FINAL_ANSWER_KEY, BaseJudge
from astuner.task_reader.reasoning_gym_reader import RECIPE_KEY, build_composite, extract, system_prompt_text
from astuner.workflow import Workflow, WorkflowOutput, WorkflowTask


class AnswerWorkflow(Workflow):
    """One model call: the system prompt, then the question; the reply is scored by the judge."""

    name = "reasoning_gym"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        recipe = workflow_task.task.metadata[RECIPE_KEY]
        messages = []
        system = system_prompt_text(recipe["system_prompt"])
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": workflow_task.task.main_query})
        reply = await model_tuner.chat(messages)
        return WorkflowOutput(reward=None, metadata={FINAL_ANSWER_KEY: reply["content"]}, response=reply["content"])


class ReasoningGymJudge(BaseJudge):
    """The dataset's own `score_answer` on the reply's answer (`extract`)."""

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        recipe = workflow_task.task.metadata.get(RECIPE_KEY)
        if recipe is None:
            raise UserError("ReasoningGymJudge scores tasks of task_reader.type reasoning_gym; this task has no "
                            f"{RECIPE_KEY!r} recipe in its metadata.")
        text = workflow_output.metadata.get(FINAL_ANSWER_KEY)
        if text is None:
            text = workflow_output.response
        if hasattr(text, "get_text_content"):  # an AgentScope Msg
            text = text.get_text_content()
        text = "" if text is None else str(getattr(text, "content", text))
        composite = build_composite(recipe["spec"])
        entry = composite[recipe["index"]]
        answer = extract(text, recipe.get("answer_from", "tag"), recipe["answer_tag"])
        try:
            score = float(composite.score_answer(answer, entry))
        except Exception as exc:  # noqa: BLE001 - the dataset's scorer failed, not the model: retried, not a zero
            source = entry["metadata"].get("source_dataset", "reasoning_gym")
            raise env_failures.failure(source, "score_answer", exc) from exc
        workflow_output.metrics[f"score/{entry['metadata'].get('source_dataset', 'unknown')}"] = score
        workflow_output.metrics["answered"] = float(answer is not None)
        return score, score >= 1.0
