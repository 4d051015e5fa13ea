"""TextArena's games (https://github.com/LeonGuertler/TextArena), played unchanged turn by turn.

    astuner:
      task_reader:
        type: textarena
        textarena:
          env_id: GuessTheNumber-v0      # any registered game
          env_kwargs: {}                 # its constructor's arguments
          opponent: null                 # two-player games: policy | 'module->function'
          size: 256                      # training games (seeds)
          validation_size: 32

One episode is one game of TextArena's raw variant (astuner/task_reader/textarena_reader.py). The model holds one
conversation per seat: each turn the game's new messages (its prompt, board, hints, the other seat's moves) are a
user message and the model's reply is its move, whole, as TextArena's own agents send it (a game reads the move out
of it, e.g. the `[5]` in "I guess [5]"). So every call of a game extends the previous one token for token and a
game trains as one merged sample where `multi_turn.sample_mode` is merge.

The other seat of a two-player game (`opponent`): `policy`, the same model in a conversation of its own whose
calls are recorded but never trained (agent `opponent`), or a function of yours, `observation -> move` (sync or
async), such as a scripted or random player. The reward is the game's own for seat 0, from `env.close()` (TextArena:
1 a win, -1 or 0 a loss, some games a score between); success is a full reward of 1. A game still running after
`max_turns` of the model's moves is stopped unfinished: reward 0, counted as `metrics/unfinished`. A game whose
own call (set-up, observation, step, close) raises or runs past `rollout.env_timeout` is a failed environment, not a
loss: the episode is flagged, left out of training and its group, and played again with a fresh game
(astuner/environments/failures.py). A scripted opponent's error is the game's too.
"""

from __future__ import annotations

import inspect

from astuner.environments import failures as env_failures
from astuner.environments import outcome_of
from astuner.model_tuner import ModelTuner
from astuner.task_judge.base_judge import BaseJudge
from astuner.task_reader.textarena_reader import POLICY_OPPONENT, RECIPE_KEY, make_game
from astuner.workflow import Workflow, WorkflowOutput, WorkflowTask, load_class

OUTCOME_KEY = "textarena_outcome"  # WorkflowOutput.metadata: what the judge scores
LEARNER = 0  # the seat that trains


def observation_text(observation, seat: int) -> str:
    """The entries new to `seat` as TextArena's own agents read them: the game's as "[GAME] ...", another
    player's moves as "[Player k] ..."; the seat's own moves are already its assistant messages."""
    lines = []
    for sender, message, _kind in observation:
        if sender == seat:
            continue
        lines.append(f"[GAME] {message}" if sender == -1 else f"[Player {sender}] {message}")
    return "\n".join(lines)


class Seat:
    """One seat's conversation with the model (the learner's, or the policy playing the opponent)."""

    def __init__(self, model, system_prompt: str) -> None:
        self.model = model
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []

    async def move(self, observation: str) -> str:
        self.messages.append({"role": "user", "content": observation})
        reply = await self.model.chat(self.messages)
        content = reply.get("content") or ""
        self.messages.append({"role": "assistant", "content": content})
        return content


class GameWorkflow(Workflow):
    """One game for seat 0 (module docstring); its outcome goes to the judge."""

    name = "textarena"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        recipe = workflow_task.task.metadata[RECIPE_KEY]
        game = recipe["env_id"]

        def env_call(operation: str, fn, *args, **kwargs):
            return env_failures.call(game, operation, fn, *args, **kwargs)

        env = await env_call("set-up", make_game, recipe)
        seats = {LEARNER: Seat(model_tuner, recipe.get("system_prompt") or "")}
        scripted = None
        if recipe.get("opponent") == POLICY_OPPONENT:
            seats[1] = Seat(model_tuner.for_agent("opponent", trainable=False), recipe.get("system_prompt") or "")
        elif recipe.get("opponent"):
            scripted = load_class(recipe["opponent"])
        moves, done, last = 0, False, ""
        while not done and moves < recipe["max_turns"]:
            seat, observation = await env_call("get_observation", env.get_observation)
            text = observation_text(observation, seat)
            if seat in seats:
                action = await seats[seat].move(text)
                if seat == LEARNER:
                    moves, last = moves + 1, action
            else:
                action = await self._scripted(game, scripted, text)
            done, _info = await env_call("step", env.step, action=str(action))
        outcome = {"finished": done, "moves": moves, "reward": 0.0, "invalid_move": False, "reason": ""}
        if done:
            rewards, info = await env_call("close", env.close)
            seat_info = (info or {}).get(LEARNER, {})
            outcome.update(reward=float(rewards[LEARNER]), invalid_move=bool(seat_info.get("invalid_move")),
                           reason=str(seat_info.get("reason", "")))
        return WorkflowOutput(reward=None, metadata={OUTCOME_KEY: outcome, "final_answer": last}, response=last)

    @staticmethod
    async def _scripted(game: str, opponent, text: str) -> str:
        """The scripted opponent's move; its error is the environment's (the model did nothing wrong)."""
        try:
            action = opponent(text)
            return await action if inspect.isawaitable(action) else action
        except Exception as exc:  # noqa: BLE001 - quoted in the episode's error
            raise env_failures.failure(game, "opponent's move", exc) from exc


class GameJudge(BaseJudge):
    """The game's own reward for seat 0; a win (reward 1) is a success."""

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        outcome = outcome_of(workflow_output, OUTCOME_KEY, "textarena")
        workflow_output.metrics.update({"unfinished": float(not outcome["finished"]),
                                        "invalid_move": float(outcome["invalid_move"]),
                                        "moves": float(outcome["moves"])})
        return outcome["reward"], outcome["reward"] >= 1.0
