"""`astuner warmstart --conf x.yaml`: a supervised warm start that fits the workflow's own tools.

1. the tools: the OpenAI function schemas the agent offers, read from a dry run (a few greedy episodes of the
   workflow on its validation tasks, or its first training tasks, each model call recording the `tools` of its
   request), or given with `--tools FILE` (a JSON list of schemas) for an agent whose tools are known up front;
2. demonstrations with made-up twins of those tools (astuner/tool_demos.py: same argument shapes and types, none
   of the user's names, so the task itself is left to GRPO), written to `<folder>/demonstrations.jsonl`;
3. the SFT: `algorithm.type: sft` on them (offline/run.py), with the config's model, chat template, tool prompt
   and trainer settings, so the protocol learned is the one the rollouts render. The folder is
   `<experiment_dir>_warmstart` (a fresh `_N` when it holds a run); its last checkpoint is what GRPO starts from.
4. the command to run next: GRPO from that checkpoint, in a folder of its own (`<experiment_dir>_from_warmstart`),
   since the config's folder may hold a run of the base model that a resume would refuse to continue.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError

log = logging.getLogger(__name__)

DEMONSTRATIONS = "demonstrations.jsonl"
TOOLS = "tools.json"


@dataclass(frozen=True)
class WarmStartResult:
    checkpoint: Path  # the SFT's last checkpoint
    command: str  # the GRPO run to start next (grpo_command)


@dataclass(frozen=True)
class WarmStartSettings:
    count: int = 32  # demonstrations (the agent quick-start's hand-written warm start had 32)
    epochs: int = 2
    dry_run_episodes: int = 4
    seed: int = 0
    chain_share: float | None = None  # episodes that chain two calls; None: tool_demos.default_chain_share
    lr: float = 5.0e-5  # the agent quick-start's SFT rate; a GRPO config's own lr is usually far lower
    batch_size: int = 4


def read_tools_file(path: Path) -> list[dict]:
    """The tool schemas of a JSON file: a list of OpenAI function schemas (or bare function objects), each one
    checked (tool_schema.check_tools) so that a schema the twins cannot copy stops here, naming the field."""
    where = f"warmstart --tools {path}"
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; give a JSON file holding a list of OpenAI function schemas") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: not JSON ({exc}); give a list of OpenAI function schemas") from None
    if isinstance(tools, dict) and isinstance(tools.get("tools"), list):
        tools = tools["tools"]  # a request body ({"tools": [...]}) pasted as it is
    if not isinstance(tools, list) or not tools:
        raise UserError(f"{where}: expected a non-empty JSON list of schemas like {{\"type\": \"function\", "
                        "\"function\": {\"name\": ..., \"parameters\": {...}}}")
    checked(tools, where)
    return tools


def checked(tools: list, where: str) -> list[str]:
    """The notes of tool_schema.check_tools (what the twins drop); its UserError prefixed with `where`."""
    from astuner.tool_schema import check_tools

    try:
        return check_tools(tools)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def distinct_tools(calls) -> list[dict]:
    """The tool schemas offered over `calls` (LLMCall records), one per tool name, first seen first."""
    by_name: dict[str, dict] = {}
    for call in calls:
        for tool in call.tools or []:
            by_name.setdefault(tool["function"]["name"], tool)
    return list(by_name.values())


def tools_from_dry_run(loaded, episodes: int) -> list[dict]:
    """Run `episodes` greedy episodes of the workflow (validation tasks first) and collect the tools offered."""
    from astuner import preflight
    from astuner.runtime import (
        build_engine,
        build_judge,
        build_policy_model_path,
        build_runner,
        load_tokenizer,
        load_workflow,
        quiet_library_progress,
    )
    from astuner.task_reader import build_task_reader

    typed = loaded.typed
    quiet_library_progress()
    workflow_cls, judge = load_workflow(loaded), build_judge(loaded)
    reader = build_task_reader(typed, loaded.config_dir)
    tasks = (reader.validation_tasks() or reader.training_tasks())[:episodes]
    if not tasks:
        raise UserError("warmstart: the config has no tasks to run the dry run on; give the tools with --tools FILE "
                        "(a JSON list of OpenAI function schemas)")
    model_path = build_policy_model_path(typed)
    facts = preflight.read_model_facts(model_path)
    max_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len, facts,
                                              typed.astuner.rollout.max_response_length_in_one_turn)
    tokenizer = load_tokenizer(model_path)
    engine = build_engine(typed, model_path, tokenizer, max_len)
    runner = build_runner(loaded, engine, tokenizer, workflow_cls, judge, model_path, max_len)
    try:
        done = runner.run(tasks, validation=True)
    finally:
        runner.close()
        engine.shutdown()
    tools = distinct_tools(call for episode in done for call in episode.calls)
    if not tools:
        errors = [e.error_summary for e in done if e.error_summary]
        why = f"; the episodes failed: {errors[0]}" if errors else ""
        raise UserError(f"warmstart: the dry run's {len(done)} episodes offered no tools to the model{why}. The "
                        "agent must pass `tools=` to the model call; or give them with --tools FILE (a JSON list of "
                        "OpenAI function schemas)")
    return tools


def warmstart_folder(loaded, out: str | None) -> Path:
    """Where the warm start writes: --out, else `<experiment_dir>_warmstart`; a fresh `_N` when it holds a run."""
    from astuner.resume import fresh_folder, holds_a_run

    folder = Path(out).expanduser().absolute() if out else loaded.experiment_dir.with_name(
        loaded.experiment_dir.name + "_warmstart")
    return fresh_folder(folder) if folder.is_dir() and holds_a_run(folder) else folder


def sft_overrides(folder: Path, settings: WarmStartSettings, project: str, user: list[str]) -> list[str]:
    """Overrides that turn the GRPO config into the warm start's SFT run. The user's own KEY=VALUE win over the
    defaults (lr, batch size, epochs, total_training_steps); the keys that make this run an SFT on the
    demonstrations cannot be overridden; the folder and the name follow from the user's (they come last)."""
    defaults = {
        "astuner.trainer_common.optim.lr": settings.lr,
        "astuner.data.train_batch_size": settings.batch_size,
        "astuner.trainer_common.total_epochs": settings.epochs,
        "astuner.trainer_common.total_training_steps": "null",  # a GRPO step count means nothing here
    }
    fixed = {
        "astuner.trainer_common.algorithm.type": "sft",
        "astuner.trainer_common.resume_mode": "disable",
        "astuner.offline_data.train_file": _quoted(folder / DEMONSTRATIONS),
        "astuner.offline_data.val_file": "null",
    }
    derived = {"astuner.project_name": f"{project}_warmstart", "astuner.experiment_dir": _quoted(folder)}
    given = {o.split("=", 1)[0].lstrip("+") for o in user}
    clash = sorted(given & set(fixed))
    if clash:
        raise UserError(f"warmstart: {', '.join(clash)} cannot be overridden here (the warm start sets them); for "
                        "another SFT, run `astuner --conf` with astuner.trainer_common.algorithm.type=sft")
    chosen = [f"{k}={v}" for k, v in defaults.items() if k not in given]
    return chosen + list(user) + [f"{k}={v}" for k, v in {**fixed, **derived}.items()]


def _quoted(path: Path) -> str:
    """A path as a Hydra override value: quoted, so spaces, '=' or brackets in it stay part of it."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def write_demonstrations(folder: Path, tools: list[dict], settings: WarmStartSettings) -> int:
    from astuner.tool_demos import demonstrations

    rows = demonstrations(tools, count=settings.count, seed=settings.seed, chain_share=settings.chain_share)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TOOLS).write_text(json.dumps(tools, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (folder / DEMONSTRATIONS).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                         encoding="utf-8")
    return len(rows)


def run_warmstart(conf: str, overrides: list[str], tools_file: str | None, out: str | None,
                  settings: WarmStartSettings, say) -> WarmStartResult:
    """The command's work (module docstring); `say(line)` reports progress and the notes on the tools."""
    from astuner.config import load_config, save_config
    from astuner.offline import run as offline_run

    loaded = load_config(conf, overrides)
    folder = warmstart_folder(loaded, out)
    sft_keys = sft_overrides(folder, settings, loaded.typed.astuner.project_name, overrides)  # refused ones: now
    if tools_file:
        tools = read_tools_file(Path(tools_file).expanduser())
        source = tools_file
    else:
        from astuner.logs import setup_logging

        # vLLM's output and the workflow's lines go to a log file, as in a run: the console keeps to progress.
        log_file = setup_logging(folder, "dry_run.log")
        say(f"warmstart: dry run of {settings.dry_run_episodes} episode(s) to read the tools the agent offers "
            f"(or give them with --tools FILE); its log: {log_file}")
        tools = tools_from_dry_run(loaded, settings.dry_run_episodes)
        source = "the dry run"
    notes = checked(tools, f"warmstart: the tools of {source}")
    names = [t.get("function", t)["name"] for t in tools]
    count = write_demonstrations(folder, tools, settings)
    say(f"warmstart: {len(tools)} tool(s) from {source} ({', '.join(names)}); {count} demonstrations with made-up "
        f"tools of the same argument shapes in {folder / DEMONSTRATIONS}")
    for note in dict.fromkeys(notes):
        say(f"warmstart: {note}")
    sft = load_config(conf, sft_keys)
    save_config(sft)
    summary = offline_run.run(sft)
    if summary.last_checkpoint is None:
        raise UserError(f"warmstart: the SFT in {folder} wrote no checkpoint; see {folder / 'astuner.log'}")
    checkpoint = Path(summary.last_checkpoint)
    return WarmStartResult(checkpoint, grpo_command(conf, overrides, grpo_folder(loaded.experiment_dir), checkpoint))


def grpo_folder(experiment_dir: Path) -> Path:
    """The GRPO run's own folder, `<experiment_dir>_from_warmstart` (a fresh `_N` when it holds a run): the
    config's folder may hold a run of the base model, which a resume from another model refuses."""
    from astuner.resume import fresh_folder, holds_a_run

    folder = experiment_dir.with_name(experiment_dir.name + "_from_warmstart")
    return fresh_folder(folder) if folder.is_dir() and holds_a_run(folder) else folder


def grpo_command(conf: str, overrides: list[str], folder: Path, checkpoint: Path) -> str:
    """The command that trains the agent from the warm start: the user's config and overrides, the checkpoint as
    the model and `folder` as the run's folder (relative to the working directory when it is under it)."""
    own = ("astuner.model.path", "astuner.experiment_dir")
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in own]
    try:
        folder = folder.relative_to(Path.cwd())
    except ValueError:
        pass
    words = ["astuner", "--conf", conf, *kept, f"astuner.model.path={checkpoint}", f"astuner.experiment_dir={folder}"]
    return " ".join(shlex.quote(str(w)) for w in words)
