"""`astuner warmstart --conf x.yaml`: a supervised warm start that fits the workflow's own tools.

1. the tools: the OpenAI function schemas the agent offers, read from a dry run (a few greedy episodes of the
   workflow on its validation tasks, or its first training tasks, each model call recording the `tools` of its
   request), or given with `--tools FILE` (a JSON list of schemas) for an agent whose tools are known up front;
2. demonstrations with made-up twins of those tools (astuner/offline/tool_demos.py: same argument shapes and types, none
   of the user's names, so the task itself is left to GRPO), written to `<folder>/demonstrations.jsonl`;
3. the SFT: `algorithm.type: sft` on them (offline/run.py), with the config's model, chat template, tool prompt
   and trainer settings, so the protocol learned is the one the rollouts render;
4. a check of the draw: episodes sampled with the warm start on the first training tasks, scored by the config's
   judge. When none scores, GRPO from it would compare equal rewards only (measured on the agent quick-start with
   an earlier generator: half the draws did that), so other demonstrations are drawn (the next seed), up to
   `draws` warm starts;
5. the command to run next: GRPO from that checkpoint, in a folder of its own (`<experiment_dir>_from_warmstart`),
   since the config's folder may hold a run of the base model that a resume would refuse to continue.

The folder is `<experiment_dir>_warmstart` (a fresh `_N` when it is not empty): the dry run's log, each draw's SFT
run in `draw_<N>/` (its demonstrations, tools, log and checkpoints), and `model`, a link to the checkpoint kept, so
the path to train from is the same whichever draw was kept (what a tutorial's command can name).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from astuner.config.derived import run_facts
from astuner.engine.build import build_engine
from astuner.errors import UserError
from astuner.task_judge.loading import build_judge
from astuner.workflow import load_workflow

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
    fresh_dry_run: bool = False  # run the dry run even when an earlier one read the same agent's tools
    draws: int = 3  # warm starts tried (seeds seed, seed + 1, ...) until one's sampled episodes score
    check_tasks: int = 8
    check_samples: int = 4  # episodes per task, at the config's temperature
    chain_share: float | None = None  # episodes that chain two calls; None: tool_demos.default_chain_share
    # Episodes that gather two numbers and compute the answer; None: all but the chains when the judge's answers look
    # computed from tool results (tool_demos.answers_are_computed), none otherwise.
    gather_share: float | None = None
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
    from astuner.offline.tool_schema import check_tools

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


def run_episodes(loaded, model_path: str, tasks: list, sampled_repeats: int | None = None,
                 desc: str = "warmstart episodes") -> list:
    """Episodes of the config's workflow and judge on `tasks` with the model at `model_path`: one greedy episode
    per task, or `sampled_repeats` per task at the config's temperature."""
    from astuner import preflight
    from astuner.runtime import build_runner, load_tokenizer, stop_token_ids

    typed = loaded.typed
    workflow_cls, judge = load_workflow(loaded), build_judge(loaded)
    facts = preflight.read_model_facts(model_path)
    max_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len, facts,
                                              typed.astuner.rollout.max_response_length_in_one_turn)
    tokenizer = load_tokenizer(model_path)
    engine = build_engine(typed, model_path, tokenizer, max_len, engine=run_facts(typed).engine)
    runner = build_runner(loaded, engine, tokenizer, workflow_cls, judge, stop_token_ids(model_path, tokenizer),
                          max_len)
    from tqdm import tqdm

    bar = tqdm(total=len(tasks) * (sampled_repeats or 1), desc=desc, unit="episode", file=sys.stderr,
               dynamic_ncols=True)
    try:
        return runner.run(tasks, validation=True, sampled_repeats=sampled_repeats,
                          on_episode_done=lambda _: bar.update(1))
    finally:
        bar.close()
        runner.close()
        engine.shutdown()


def tools_from_dry_run(loaded, episodes: int) -> tuple[list[dict], list[str]]:
    """Run `episodes` greedy episodes of the workflow (validation tasks first); the tools offered, and the tool
    results the episodes' later calls were shown (none when the model called no tool)."""
    from astuner.runtime import model_set, quiet_library_progress
    from astuner.task_reader import build_task_reader

    quiet_library_progress()
    reader = build_task_reader(loaded.typed, loaded.config_dir)
    tasks = (reader.validation_tasks() or reader.training_tasks())[:episodes]
    if not tasks:
        raise UserError("warmstart: the config has no tasks to run the dry run on; give the tools with --tools FILE "
                        "(a JSON list of OpenAI function schemas)")
    done = run_episodes(loaded, model_set(loaded.typed).first.folder, tasks, desc="warmstart: dry run")
    tools = distinct_tools(call for episode in done for call in episode.calls)
    if not tools:
        errors = [e.error_summary for e in done if e.error_summary]
        why = f"; the episodes failed: {errors[0]}" if errors else ""
        raise UserError(f"warmstart: the dry run's {len(done)} episodes offered no tools to the model{why}. The "
                        "agent must pass `tools=` to the model call; or give them with --tools FILE (a JSON list of "
                        "OpenAI function schemas)")
    results = [str(m.get("content")) for e in done for c in e.calls for m in (c.messages or [])
               if isinstance(m, dict) and m.get("role") == "tool"]
    return tools, results


def task_answers(loaded, limit: int = 64) -> list:
    """The answers the judge compares with, from the first training tasks' rows (answer, ground_truth, solution)."""
    from astuner.task_judge.base_judge import GROUND_TRUTH_KEYS
    from astuner.task_reader import build_task_reader

    rows = [t.metadata for t in build_task_reader(loaded.typed, loaded.config_dir).training_tasks()[:limit]]
    return [r[next(k for k in GROUND_TRUTH_KEYS if k in r)] for r in rows
            if isinstance(r, dict) and any(k in r for k in GROUND_TRUTH_KEYS)]


def episode_kinds(settings: "WarmStartSettings", tools: list[dict], answers: list, results: list[str]):
    """The settings with the share of gather-then-compute episodes chosen (when not given) and the line saying
    why: every episode not a chain (none by default) when the judge's answers look computed from tool results.

    Measured on tutorial/shop (stock x price; the demo model, seed 0): with half gathering, a quarter chaining and a
    quarter single calls, the warm-started model called both tools in 88% of the validation episodes but then
    boxed the last result as a chain or a single call does in 81% of them (0.06 greedy success); a demonstration
    whose answer is read from a result teaches the wrong last step when the answers are computed."""
    from astuner.offline.tool_demos import answers_are_computed

    if settings.gather_share is not None:
        return settings, None
    if not answers_are_computed(answers, results, tools):
        return replace(settings, gather_share=0.0), None
    chain = settings.chain_share or 0.0
    seen = "none of which the dry run saw in a tool result" if results else "and the dry run saw no tool result"
    return replace(settings, gather_share=1.0 - chain, chain_share=chain), (
        f"most of the judge's answers are numbers, {seen}: {1.0 - chain:.0%} of the demonstrations gather two values "
        f"and compute the answer, {chain:.0%} chain two calls (--gather-share, --chain-share to choose)")


@dataclass(frozen=True)
class DrawCheck:
    """Sampled episodes of a warm-started model on the training tasks, scored by the config's judge."""

    episodes: int
    scored: int  # episodes that succeeded, or whose reward is above the lowest seen
    signal_tasks: int  # tasks whose episodes' rewards differ: the groups GRPO learns from
    tasks: int
    tool_calls: int = 0  # parsed tool calls handed to the agent, over every episode
    with_a_tool_call: int = 0  # episodes holding at least one
    void: str | None = None  # most episodes failed or timed out: the check measured nothing (monitor.void_note)
    example: str = ""  # what the model did in one sampled episode (its calls and its last words)

    def line(self) -> str:
        """What the check saw, in one line."""
        tools = (f"{self.tool_calls / max(self.episodes, 1):.2f} tool calls per episode, {self.with_a_tool_call} of "
                 f"{self.episodes} episodes with one")
        if self.void:
            return f"the check is void: {self.void}; its score is n/a ({tools})"
        return (f"{self.scored} of {self.episodes} sampled episodes on {self.tasks} training task(s) scored; "
                f"{self.signal_tasks} task(s) give GRPO rewards to compare; {tools}")

    @property
    def stuck(self) -> bool:
        """No episode scored: GRPO from this model would compare equal rewards only."""
        return self.scored == 0


def draw_check(episodes: list) -> DrawCheck:
    rewards = [e.reward for e in episodes]
    low = min(rewards, default=0.0)
    by_task: dict[str, set] = {}
    for e in episodes:
        by_task.setdefault(e.task.task_id, set()).add(e.reward)
    from astuner.monitor.metrics import tool_calls_received, void_note

    calls = [tool_calls_received(e.calls) for e in episodes]
    return DrawCheck(episodes=len(episodes), scored=sum(e.is_success or e.reward > low for e in episodes),
                     signal_tasks=sum(len(r) > 1 for r in by_task.values()), tasks=len(by_task),
                     tool_calls=sum(calls), with_a_tool_call=sum(c > 0 for c in calls), void=void_note(episodes),
                     example=episode_line(episodes[0]) if episodes else "")


def episode_line(episode, width: int = 300) -> str:
    """One episode in a line: its task, each tool call with its arguments, its last words (or its error)."""
    steps = []
    for call in getattr(episode, "calls", []):
        reply = call.reply or {}
        for tool_call in reply.get("tool_calls") or []:
            function = tool_call.get("function", tool_call)
            steps.append(f"{function.get('name')}({function.get('arguments', '')})")
    calls = getattr(episode, "calls", [])
    last = getattr(episode, "error_summary", None) or (
        ((calls[-1].reply or {}).get("content") or calls[-1].response_text) if calls else "")
    text = f"task {episode.task.task_id}, reward {episode.reward:g}: " + " -> ".join(
        steps + [repr(" ".join(str(last).split())[:120])])
    return text if len(text) <= width else text[:width - 3] + "..."


def check_warm_start(loaded, checkpoint: Path, settings: WarmStartSettings) -> DrawCheck:
    """Sample `check_samples` episodes on each of the first `check_tasks` training tasks with the warm start."""
    from astuner.task_reader import build_task_reader

    reader = build_task_reader(loaded.typed, loaded.config_dir)
    tasks = (reader.training_tasks() or reader.validation_tasks())[:settings.check_tasks]
    return draw_check(run_episodes(loaded, str(checkpoint), tasks, settings.check_samples, desc="warmstart: check"))


KEPT = "model"  # the link, in the warm start's folder, to the checkpoint kept


def warmstart_base(loaded, out: str | None) -> Path:
    """The warm start's folder before numbering: --out, else `<experiment_dir>_warmstart`."""
    return Path(out).expanduser().absolute() if out else loaded.experiment_dir.with_name(
        loaded.experiment_dir.name + "_warmstart")


def warmstart_folder(base: Path) -> Path:
    """Where the warm start writes: `base`, or a fresh `base_N` when it is not empty."""
    folder, n = base, 1
    while folder.is_file() or folder.is_dir() and any(folder.iterdir()):
        folder, n = base.with_name(f"{base.name}_{n}"), n + 1
    return folder


def keep(folder: Path, checkpoint: Path) -> Path:
    """`folder/model`, a relative link to `checkpoint` (the folder moves with it); that path."""
    link = folder / KEPT
    link.symlink_to(os.path.relpath(checkpoint.absolute(), folder.absolute()), target_is_directory=True)
    return link


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
    from astuner.offline.tool_demos import demonstrations

    rows = demonstrations(tools, count=settings.count, seed=settings.seed, chain_share=settings.chain_share,
                          gather_share=settings.gather_share or 0.0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TOOLS).write_text(json.dumps(tools, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (folder / DEMONSTRATIONS).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                         encoding="utf-8")
    return len(rows)


def read_tools(loaded, base: Path, folder: Path, tools_file: str | None, settings: WarmStartSettings, say):
    """(tools, tool results seen, where they came from): --tools FILE, else the dry run of an earlier warm start of
    the same agent in `base` or a `base_N` (offline/dry_run.py), else a dry run now, saved in `folder` for the
    next."""
    from astuner.logs import setup_logging
    from astuner.offline.dry_run import DryRun, agent_fingerprint, earlier_dry_run, save_dry_run

    if tools_file:
        return read_tools_file(Path(tools_file).expanduser()), [], tools_file
    fingerprint = agent_fingerprint(loaded)
    earlier = None if settings.fresh_dry_run else earlier_dry_run(base, fingerprint)
    if earlier is not None:
        say(f"warmstart: the tools of the dry run in {earlier.folder} (the agent's code and rollout settings are "
            "unchanged since; --fresh-dry-run to read them again)")
        save_dry_run(folder, earlier)
        return earlier.tools, earlier.results, f"the dry run in {earlier.folder}"
    # vLLM's output and the workflow's lines go to a log file, as in a run: the console keeps to progress.
    log_file = setup_logging(folder, "dry_run.log")
    say(f"warmstart: dry run of {settings.dry_run_episodes} episode(s) to read the tools the agent offers "
        f"(or give them with --tools FILE); its log: {log_file}")
    tools, results = tools_from_dry_run(loaded, settings.dry_run_episodes)
    save_dry_run(folder, DryRun(folder, fingerprint, tools, results))
    return tools, results, "the dry run"


def run_warmstart(conf: str, overrides: list[str], tools_file: str | None, out: str | None,
                  settings: WarmStartSettings, say) -> WarmStartResult:
    """The command's work (module docstring); `say(line)` reports progress and the notes on the tools."""
    from astuner.config import load_config
    from astuner.logs import setup_logging

    loaded = load_config(conf, overrides)
    base = warmstart_base(loaded, out)
    folder = warmstart_folder(base)
    project = loaded.typed.astuner.project_name
    sft_overrides(folder, settings, project, overrides)  # keys it refuses stop the command now
    folder.mkdir(parents=True, exist_ok=True)
    tools, results, source = read_tools(loaded, base, folder, tools_file, settings, say)
    notes = checked(tools, f"warmstart: the tools of {source}")
    names = [t.get("function", t)["name"] for t in tools]
    for note in dict.fromkeys(notes):
        say(f"warmstart: {note}")
    settings, kinds = episode_kinds(settings, tools, task_answers(loaded), results)
    if kinds:
        say(f"warmstart: {kinds}")
    for draw in range(settings.draws):
        seed = settings.seed + draw
        run = folder / f"draw_{draw + 1}"
        count = write_demonstrations(run, tools, replace(settings, seed=seed))
        say(f"warmstart: draw {draw + 1} of at most {settings.draws} (seed {seed}): {len(tools)} tool(s) from {source} "
            f"({', '.join(names)}); {count} demonstrations with made-up tools of the same argument shapes in "
            f"{run / DEMONSTRATIONS}")
        checkpoint = _sft(conf, sft_overrides(run, settings, project, overrides), run)
        setup_logging(run, "check.log")
        check = check_warm_start(loaded, checkpoint, settings)
        say(f"warmstart: {checkpoint}: {check.line()} (log: {run / 'check.log'})")
        if check.example:
            say(f"warmstart: one sampled episode: {check.example}")
        if check.void:
            say("warmstart: WARNING: the check measured nothing, so another draw would not either: fix what stopped "
                f"the episodes ({run / 'check.log'} names each) and rerun; this draw is kept unchecked")
            break
        if not check.stuck:
            break
        if draw + 1 < settings.draws:
            say(f"warmstart: no episode scored, so GRPO from it would compare equal rewards only: drawing other "
                f"demonstrations (seed {seed + 1})")
        else:
            say(f"warmstart: WARNING: no draw of {settings.draws} scored on the training tasks; GRPO from the last one "
                "will likely stop without a learning signal. Try --draws with more, a few demonstrations of your own "
                "task (algorithm.type sft on offline_data), or a larger model")
    kept = keep(folder, checkpoint)
    say(f"warmstart: {kept} is {checkpoint}")
    return WarmStartResult(kept, grpo_command(conf, overrides, grpo_folder(loaded.experiment_dir), kept))


def _sft(conf: str, sft_keys: list[str], folder: Path) -> Path:
    """The SFT of one draw; its last checkpoint."""
    from astuner.config import load_config, save_config
    from astuner.offline import run as offline_run

    sft = load_config(conf, sft_keys)
    save_config(sft)
    summary = offline_run.run(sft)
    if summary.last_checkpoint is None:
        raise UserError(f"warmstart: the SFT in {folder} wrote no checkpoint; see {folder / 'astuner.log'}")
    return Path(summary.last_checkpoint)


def grpo_folder(experiment_dir: Path) -> Path:
    """The GRPO run's own folder, `<experiment_dir>_from_warmstart` (a fresh `_N` when it holds a run): the
    config's folder may hold a run of the base model, which a resume from another model refuses."""
    from astuner.resume import fresh_folder, holds_a_run

    folder = experiment_dir.with_name(experiment_dir.name + "_from_warmstart")
    return fresh_folder(folder) if folder.is_dir() and holds_a_run(folder) else folder


def _from_here(path: Path) -> Path:
    """`path` relative to the working directory when it is under it (a command to copy reads shorter)."""
    try:
        return path.absolute().relative_to(Path.cwd())
    except ValueError:
        return path


def grpo_command(conf: str, overrides: list[str], folder: Path, checkpoint: Path) -> str:
    """The command that trains the agent from the warm start: the user's config and overrides, the checkpoint as
    the model and `folder` as the run's folder (relative to the working directory when it is under it)."""
    own = ("astuner.model.path", "astuner.experiment_dir")
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in own]
    folder, checkpoint = _from_here(folder), _from_here(checkpoint)
    words = ["astuner", "--conf", conf, *kept, f"astuner.model.path={checkpoint}", f"astuner.experiment_dir={folder}"]
    return " ".join(shlex.quote(str(w)) for w in words)
