"""TextArena's games played unchanged (astuner/environments/textarena.py): real games of the real package, a model
faked where the game's side is what is checked, and the real CLI on the tiny model (the tutorial's commands run in
tests/test_tutorial_commands.py)."""

from __future__ import annotations

import asyncio
import re

import pytest

from astuner.environments.textarena import OUTCOME_KEY, GameJudge, GameWorkflow, observation_text
from astuner.errors import UserError
from astuner.task_reader.textarena_reader import RECIPE_KEY
from astuner.types import Task
from astuner.workflow import WorkflowTask


def recipe(env_id="GuessTheNumber-v0", seed=3, opponent=None, max_turns=10, **env_kwargs):
    """`max_turns`: ours (the model's moves); the game's own arguments go in env_kwargs (`game_turns` for its
    max_turns)."""
    if "game_turns" in env_kwargs:
        env_kwargs["max_turns"] = env_kwargs.pop("game_turns")
    return {"env_id": env_id, "env_kwargs": env_kwargs, "seed": seed, "opponent": opponent, "max_turns": max_turns,
            "system_prompt": "Play well."}


def play(r: dict):
    task = WorkflowTask(Task(task_id="t", main_query="game", metadata={RECIPE_KEY: r}))
    return asyncio.run(GameWorkflow().execute(task, Model()))


class Model:
    """A player that reads the game as the model would: each call gets the conversation so far. It bisects Guess
    The Number from the hints, and takes TicTacToe's first available square."""

    def __init__(self, agent: str = "", trainable: bool = True, calls: list | None = None) -> None:
        self.agent, self.trainable = agent, trainable
        self.calls = [] if calls is None else calls
        self.low, self.high, self.guess = 1, 5, None

    def for_agent(self, name: str, trainable: bool = True) -> "Model":
        return Model(name, trainable, self.calls)

    async def chat(self, messages: list[dict]) -> dict:
        self.calls.append((self.agent, self.trainable, [dict(m) for m in messages]))
        last = messages[-1]["content"]
        if "Available Moves" in last:  # the latest board's
            return {"role": "assistant", "content": re.findall(r"'(\[\d\])'", last.rsplit("Available Moves")[-1])[0]}
        if "target number is higher" in last:
            self.low = self.guess + 1
        elif "target number is lower" in last:
            self.high = self.guess - 1
        self.guess = (self.low + self.high) // 2
        return {"role": "assistant", "content": f"I guess [{self.guess}]."}


def test_observation_text_names_the_game_and_the_other_player_and_skips_the_seats_own_moves():
    entries = [(-1, "Board", 5), (1, "[4]", 2), (0, "[3]", 2), (-1, "Your turn", 4)]
    assert observation_text(entries, 0) == "[GAME] Board\n[Player 1] [4]\n[GAME] Your turn"


def test_a_game_is_one_growing_conversation_and_its_own_outcome_is_the_reward():
    model = Model()
    task = WorkflowTask(Task(task_id="t", main_query="game",
                             metadata={RECIPE_KEY: recipe(min_number=1, max_number=5, max_turns=4)}))
    output = asyncio.run(GameWorkflow().execute(task, model))
    outcome = output.metadata[OUTCOME_KEY]
    assert outcome["finished"] and outcome["reward"] == 1.0 and not outcome["invalid_move"]
    assert GameJudge(None).compute_reward(task, output) == (1.0, True)  # a win: TextArena's 1
    calls = [messages for _, _, messages in model.calls]
    assert calls[0][0] == {"role": "system", "content": "Play well."}
    assert calls[0][1]["content"].startswith("[GAME] You are Player 0") and "between 1 and 5" in calls[0][1]["content"]
    for before, after in zip(calls, calls[1:]):  # each call extends the last: the game trains as one sample
        assert after[:len(before)] == before and after[len(before)]["role"] == "assistant"
        assert "I guess" not in after[-1]["content"]  # the game's hint, not the model's own move again
    assert output.response == output.metadata["final_answer"] == f"I guess [{model.guess}]."


def test_a_two_player_game_against_a_scripted_opponent_or_the_untrained_policy():
    for opponent in ("tests.test_textarena->last_free", "policy"):
        model = Model()
        task = WorkflowTask(Task(task_id="t", main_query="game",
                                 metadata={RECIPE_KEY: recipe("TicTacToe-v0", seed=1, opponent=opponent)}))
        outcome = asyncio.run(GameWorkflow().execute(task, model)).metadata[OUTCOME_KEY]
        assert outcome["finished"], opponent
        seats = {(agent, trainable) for agent, trainable, _ in model.calls}
        if opponent == "policy":  # both seats the model's, the opponent's calls never trained
            assert seats == {("", True), ("opponent", False)}
            # both take the first free square: seat 0 (O) fills 0, 2, 4, 6 between X's 1, 3, 5: a win on 2-4-6
            assert (outcome["reward"], outcome["moves"]) == (1.0, 4)
        else:
            assert seats == {("", True)}  # the function played the other seat: O 0, X 8, O 1, X 7, O 2 wins
            assert (outcome["reward"], outcome["moves"]) == (1.0, 3)
            assert "[Player 1]" in model.calls[1][2][-1]["content"]  # the opponent's move, shown to seat 0


def last_free(observation: str) -> str:
    """A scripted TicTacToe player: the last available square."""
    return re.findall(r"'(\[\d\])'", observation.rsplit("Available Moves")[-1])[-1]


def test_a_game_still_running_at_max_turns_is_unfinished_and_scores_zero():
    output = play(recipe(min_number=1, max_number=20, max_turns=1))  # one guess of 1..20: rarely the number
    outcome = output.metadata[OUTCOME_KEY]
    assert outcome == {"finished": False, "moves": 1, "reward": 0.0, "invalid_move": False, "reason": ""}
    task = WorkflowTask(Task(task_id="t", main_query="game"))
    assert GameJudge(None).compute_reward(task, output) == (0.0, False)
    assert output.metrics["unfinished"] == 1.0 and output.metrics["moves"] == 1.0


def test_a_game_textarena_refuses_stops_at_start_naming_the_key(tmp_path):
    from astuner.task_reader.textarena_reader import check_game

    with pytest.raises(UserError, match="Did you mean GuessTheNumber-v0"):
        check_game(recipe("GuessTheNumbr-v0"))
    with pytest.raises(UserError, match="set opponent"):
        check_game(recipe("TicTacToe-v0"))  # two players, none given
    with pytest.raises(UserError, match="env_kwargs"):
        check_game(recipe(no_such_argument=1))


def test_a_lost_game_keeps_the_games_partial_reward_and_is_no_success():
    # The game allows one guess of 1..20 (the guesser bisects 1..5 and says 3): lost, and Guess The Number scores
    # a loss by how close the guess came, a number between 0 and 1.
    output = play(recipe(min_number=1, max_number=20, max_turns=10, game_turns=1))
    outcome = output.metadata[OUTCOME_KEY]
    assert outcome["finished"] and 0.0 < outcome["reward"] < 1.0
    task = WorkflowTask(Task(task_id="t", main_query="game"))
    assert GameJudge(None).compute_reward(task, output) == (outcome["reward"], False)


def test_the_config_makes_one_task_per_seed_with_the_games_own_workflow_and_judge(tmp_path, monkeypatch):
    import sys

    from astuner.config import load_config
    from astuner.task_judge.loading import judge_spec
    from astuner.workflow import workflow_spec
    from astuner.task_reader import build_task_reader
    from conftest import REPO

    yaml = REPO / "tutorial" / "textarena" / "textarena.yaml"
    loaded = load_config(yaml, ["astuner.seed=7", "astuner.task_reader.textarena.size=3",
                                "astuner.task_reader.textarena.validation_size=2"])
    reader = build_task_reader(loaded.typed, yaml.parent)
    train, val = reader.training_tasks(), reader.validation_tasks()
    assert [t.metadata[RECIPE_KEY]["seed"] for t in train] == [7, 8, 9]
    assert [t.task_id for t in val] == ["validation-0", "validation-1"]
    assert {t.metadata[RECIPE_KEY]["seed"] for t in val}.isdisjoint({7, 8, 9})
    assert train[0].metadata[RECIPE_KEY]["env_kwargs"] == {"min_number": 1, "max_number": 5, "max_turns": 4}
    assert workflow_spec(loaded.typed) == "astuner.environments.textarena->GameWorkflow"
    assert judge_spec(loaded.typed) == "astuner.environments.textarena->GameJudge"
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(UserError, match=r"pip install 'astuner\[textarena\]'"):
        build_task_reader(loaded.typed, yaml.parent)


def test_an_opponent_that_does_not_load_stops_at_start(tmp_path):
    from astuner.config import load_config
    from astuner.task_reader import build_task_reader
    from conftest import REPO

    yaml = REPO / "tutorial" / "textarena" / "tictactoe.yaml"
    for wrong in ("no_such_file.py->random_move", "no_such_module->move", "opponents.py"):
        loaded = load_config(yaml, [f"astuner.task_reader.textarena.opponent='{wrong}'"])
        with pytest.raises(UserError, match="opponent="):
            build_task_reader(loaded.typed, yaml.parent)
    task = build_task_reader(load_config(yaml).typed, yaml.parent).training_tasks()[0]
    # made absolute: an episode may run in another process and folder
    assert task.metadata[RECIPE_KEY]["opponent"] == f"{(yaml.parent / 'opponents.py').resolve()}->random_move"
