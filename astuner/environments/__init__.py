"""Environments others wrote, trained unchanged: a task reader type names one, and it brings its own tasks,
workflow and reward.

ENVIRONMENTS maps a `task_reader.type` to the workflow and judge that play it. A run whose
`rollout.agentscope_workflow` is null gets the environment's workflow; one whose `task_judge` is left at its
default (`judge_protocol` unchanged, no `combine`) gets the environment's judge. Naming your own workflow (an agent
with tools that answers the environment's questions) or judge works as for any task.
Each environment's package is an optional extra of pyproject.toml (`pip install 'astuner[reasoning-gym]'`,
`'astuner[textarena]'`, `'astuner[openenv]'`, `'astuner[verifiers]'`: an environment of its own); its reader stops a run that lacks it at start (exit 2) with that line.
"""

from __future__ import annotations

from dataclasses import dataclass

from astuner.errors import UserError


@dataclass(frozen=True)
class Environment:
    workflow: str  # "module->Class" spec, as a user would write it
    judge: str


ENVIRONMENTS: dict[str, Environment] = {
    "reasoning_gym": Environment(
        workflow="astuner.environments.reasoning_gym->AnswerWorkflow",
        judge="astuner.environments.reasoning_gym->ReasoningGymJudge",
    ),
    "textarena": Environment(
        workflow="astuner.environments.textarena->GameWorkflow",
        judge="astuner.environments.textarena->GameJudge",
    ),
    "openenv": Environment(
        workflow="astuner.environments.openenv->EpisodeWorkflow",
        judge="astuner.environments.openenv->EpisodeJudge",
    ),
    "verifiers": Environment(
        workflow="astuner.environments.verifiers_env->EpisodeWorkflow",
        judge="astuner.environments.verifiers_env->EpisodeJudge",
    ),
}


def environment_of(task_reader_type: str) -> Environment | None:
    return ENVIRONMENTS.get(str(task_reader_type))


def outcome_of(workflow_output, key: str, kind: str) -> dict:
    """What an environment's own workflow left its judge under `key`; a UserError when another workflow ran."""
    outcome = workflow_output.metadata.get(key)
    if outcome is None:
        raise UserError(f"the judge of task_reader.type {kind} scores the episodes of its own workflow "
                        f"({ENVIRONMENTS[kind].workflow}); this episode's output has no {key!r}. With a workflow "
                        "of your own, return the environment's reward yourself.")
    return outcome
