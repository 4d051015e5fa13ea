"""`textarena`: games of TextArena (https://github.com/LeonGuertler/TextArena), one task per game seed
(astuner/environments/textarena.py plays them).

Training: games seeded `seed .. seed + size - 1` (null seed: astuner.seed); validation: `validation_size` games
under other seeds. Task ids are "<split>-<index>". A task keeps its recipe (game id, its arguments, seed, opponent,
turn cap), so any process can set the very same game up again. The reader sets one game up at start: an unknown
game, arguments the game refuses or a two-player game without an opponent stop the run there (exit 2).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import SeededTaskReader
from astuner.types import Task

SECTION = "astuner.task_reader.textarena"
RECIPE_KEY = "textarena"  # Task.metadata[RECIPE_KEY]: {"env_id", "env_kwargs", "seed", "opponent", "max_turns", ...}
POLICY_OPPONENT = "policy"  # the other seat played by the model itself, its calls never trained


def import_textarena():
    try:
        import textarena
    except ModuleNotFoundError as exc:
        raise UserError(f"task_reader.type textarena needs the textarena package ({exc}): pip install "
                        "'astuner[textarena]' (or pip install textarena==0.7.4) in this environment.") from None
    return textarena


def make_game(recipe: dict[str, Any]):
    """The recipe's game, reset to its seed: TextArena's raw variant (`<env_id>-raw`), whose observations are the
    new (sender, message, kind) entries since the player's last turn, so a conversation holds each once."""
    ta = import_textarena()
    env = ta.make(env_id=f"{recipe['env_id']}-raw", **recipe["env_kwargs"])
    env.reset(num_players=players(recipe), seed=int(recipe["seed"]))
    return env


def players(recipe: dict[str, Any]) -> int:
    return 1 if recipe.get("opponent") is None else 2


def check_game(recipe: dict[str, Any]) -> None:
    """Set the recipe's game up once; UserError naming the key when TextArena refuses it."""
    ta = import_textarena()
    from textarena.envs.registration import ENV_REGISTRY

    env_id = recipe["env_id"]
    if env_id not in ENV_REGISTRY or f"{env_id}-raw" not in ENV_REGISTRY:
        games = sorted(k for k in ENV_REGISTRY if not k.endswith("-raw") and k.count("-") == 1)
        close = difflib.get_close_matches(str(env_id), games, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"{SECTION}.env_id={env_id!r} is not a TextArena game.{hint} TextArena "
                        f"{getattr(ta, '__version__', '')} has {len(games)}, e.g. {', '.join(games[:8])}.")
    try:
        make_game(recipe)
    except Exception as exc:  # noqa: BLE001 - the game's own refusal (player count, arguments), said as such
        need = (" It may be a two-player game: set opponent (policy, or a 'module->function' that answers an "
                "observation with an action).") if recipe.get("opponent") is None else ""
        raise UserError(f"{SECTION}: TextArena could not set up {env_id} with env_kwargs {recipe['env_kwargs']} "
                        f"for {players(recipe)} player(s): {type(exc).__name__}: {exc}.{need}") from None


class TextArenaTaskReader(SeededTaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        self.section = reader_cfg.textarena
        opponent = self.section.opponent  # resolved once, not per game
        self.opponent = opponent if opponent in (None, POLICY_OPPONENT) else _absolute(opponent, self.base_dir)
        check_game(self._recipe(self.seed))  # a missing package or a game it refuses: stopped here, before weights

    def _recipe(self, seed: int) -> dict[str, Any]:
        return {"env_id": self.section.env_id, "env_kwargs": dict(self.section.env_kwargs), "seed": seed,
                "opponent": self.opponent, "max_turns": self.section.max_turns,
                "system_prompt": self.section.system_prompt}

    def _tasks(self, split: str, size: int, first_seed: int) -> list[Task]:
        return [Task(task_id=f"{split}-{i}", main_query=f"{self.section.env_id} (seed {first_seed + i})",
                     metadata={RECIPE_KEY: self._recipe(first_seed + i)}) for i in range(size)]


def _absolute(spec: str, base_dir: Path) -> str:
    """A 'path/file.py->name' opponent made absolute (the YAML's folder first, then the working directory, as
    workflows are found), since episodes may run in another process and folder. A file or module that is not
    there stops the run at start; the function itself is looked up by the first game."""
    import importlib.util

    target, arrow, name = spec.rpartition("->")
    where = f"{SECTION}.opponent={spec!r}"
    if not arrow or not name:
        raise UserError(f"{where}: name a function, 'module->function' or 'path/file.py->function' (observation "
                        "text -> move), or policy.")
    if target.endswith(".py"):
        found = next((d / target for d in (base_dir, Path.cwd()) if (d / target).is_file()), None)
        if found is None:
            raise UserError(f"{where}: no file {target} in {base_dir} or {Path.cwd()}.")
        return f"{found.resolve()}->{name}"
    try:
        known = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        known = False
    if not known:
        raise UserError(f"{where}: no module {target!r} importable here.")
    return spec
