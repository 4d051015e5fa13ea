"""verifiers environments (v1), played unchanged: verifiers runs its own rollout, talking to astuner's loopback
endpoint, so every model call is recorded token-exactly as any framework's.

    astuner:
      task_reader:
        type: verifiers
        verifiers:
          env_id: my_env           # the taskset module verifiers loads (env_dir: the folder holding it)
          env_args: {}             # the taskset's config keys
          agent: {}                # the agent's: harness, max_turns, ... (runtime: subprocess unless set)
          size: null               # training tasks (null: all but the validation ones)
          validation_size: 16

One episode is `Env.run_episode(task, ctx)` of the task's environment (loaded once per process,
astuner/task_reader/verifiers_reader.py), with a `ModelContext` whose client is astuner's endpoint
(`ModelTuner.base_url`, the episode's own key, the served model's name) and whose temperature is the episode's (0
in validation). Everything else is the environment's: its harness calls the model (tools, turns, streaming), its
rewards and judges score the trace. The episode's reward is the trace's (`Trace.reward`, the weighted sum of its
rewards), a success when it reaches 1; each reward's score is logged as `metrics/reward/<name>` and each metric
(a rubric's criteria: `metrics/rubric/<criterion>`) under its own name.

verifiers returns a failed rollout with reward 0 rather than raising: astuner reads its errors instead. A failure of
the environment's own parts (harness, task setup or scoring, toolset, sandbox, interception, the env's hooks) is
the environment's failure, not a 0: the episode is flagged and played again (astuner/environments/failures.py). A
failed model call (ProviderError) is astuner's own endpoint answering an error; the episode's timeout or overflow
is flagged from astuner's own record, anything else fails the episode.
"""

from __future__ import annotations

import os
import secrets

from astuner.environments import failures as env_failures
from astuner.environments import outcome_of
from astuner.model_tuner import ModelTuner
from astuner.task_judge.base_judge import BaseJudge
from astuner.task_reader.verifiers_reader import RECIPE_KEY, import_verifiers, load
from astuner.workflow import Workflow, WorkflowOutput, WorkflowTask

OUTCOME_KEY = "verifiers_outcome"  # WorkflowOutput.metadata: what the judge scores
MODEL_ERRORS = ("ProviderError",)  # the endpoint's answer: astuner's own records say what happened


def rollout_errors(episode) -> list:
    """Every error verifiers recorded for the episode: the env's own hooks' and each trace's."""
    return [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]


class EpisodeWorkflow(Workflow):
    """One rollout of the task's verifiers environment (module docstring); its outcome goes to the judge."""

    name = "verifiers"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        vf = import_verifiers()
        recipe = workflow_task.task.metadata[RECIPE_KEY]
        env, tasks = load(recipe["config"], recipe["env_dir"])
        name = recipe["config"]["taskset"]["id"]
        # verifiers reads the key from a variable it names; one per episode, so each keeps its own key.
        variable = f"ASTUNER_VF_EPISODE_{secrets.token_hex(8)}"
        os.environ[variable] = model_tuner.api_key
        ctx = vf.ModelContext(model=model_tuner.model_name,
                              client=vf.EvalClientConfig(base_url=model_tuner.base_url, api_key_var=variable),
                              sampling=vf.SamplingConfig(temperature=model_tuner.temperature))
        try:
            episode = await env.run_episode(tasks[recipe["index"]], ctx)
        finally:
            os.environ.pop(variable, None)
        errors = rollout_errors(episode)
        own = [e for e in errors if e.type not in MODEL_ERRORS]
        if own:
            raise env_failures.failure(name, own[0].type, own[0].message or "(no message)")
        if errors:
            raise RuntimeError(f"verifiers: a model call failed: {errors[0].type} {errors[0].status_code}: "
                               f"{errors[0].message}")
        trace = episode.traces[0]
        outcome = {"reward": float(trace.reward),
                   "rewards": {k: float(r.score) for k, r in trace.rewards.items() if r is not None},
                   "metrics": {k: float(v) for k, v in trace.metrics.items() if v is not None},
                   "stop": str(trace.stop_condition or ""), "turns": int(trace.num_turns or 0)}
        reply = str(trace.last_reply or "")
        return WorkflowOutput(reward=None, metadata={OUTCOME_KEY: outcome, "final_answer": reply}, response=reply)


class EpisodeJudge(BaseJudge):
    """The trace's own reward; a reward of 1 or more is a success. Its rewards and metrics are logged."""

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        outcome = outcome_of(workflow_output, OUTCOME_KEY, "verifiers")
        workflow_output.metrics.update({f"reward/{k}": v for k, v in outcome["rewards"].items()})
        workflow_output.metrics.update(outcome["metrics"])
        workflow_output.metrics["turns"] = float(outcome["turns"])
        return outcome["reward"], outcome["reward"] >= 1.0
