"""The `astuner` command: load a YAML config, warn about keys that do not apply, save a backup, run a backbone.

Only typer/click load at import so that `astuner --help` is instant; the config package (Hydra) is imported
when the command runs, and the backbone (torch and friends) only after the config is known to be good.
Every bad input ends as one `astuner: error: ...` paragraph on stderr and exit code 2, never a traceback.
"""

import os
import sys
from typing import Annotated

import typer

from astuner.cli_serve import key_app, serve_app, serve_model_app
from astuner.errors import EngineStartError, StageTimeout, TrainingStalled, UserError, WorkerLost
from astuner.interrupts import TERMINATED_EXIT, Terminated, sigterm_as_interrupt
from astuner.launch import run

# Older Typer raises the click package's exceptions; newer Typer vendors click and raises its own types.
_CLI_ERRORS: tuple = tuple(t for t in (getattr(typer, "TyperException", None),) if t)
_ABORTS: tuple = (typer.Abort,)
try:
    import click

    _CLI_ERRORS += (click.ClickException,)
    _ABORTS += (click.exceptions.Abort,)
except ImportError:  # only newer Typer gets here, and it needs no click
    pass

USAGE_EXIT = 2
INTERRUPT_EXIT = 130
STALLED_EXIT = 1

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # help text holds [lists] that rich would read as markup
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Train an LLM agent with reinforcement learning (GRPO) from a YAML config.",
)


@app.command()
def launch(
    conf: Annotated[str, typer.Option("--conf", "-c", help="The YAML config file.", show_default=False)],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="KEY=VALUE",
            help="Config overrides in Hydra syntax, e.g. astuner.rollout.temperature=0.5 "
            "astuner.rollout.compute_madness_checklist=[nonsense].",
            show_default=False,
        ),
    ] = None,
    backbone: Annotated[str, typer.Option(help="Where training runs: debug | verl | trinity.")] = "debug",
    with_ray: Annotated[
        bool, typer.Option("--with-ray", help="verl / trinity: start a local Ray cluster for this run when none "
                           "answers (without it they only join RAY_ADDRESS or the cluster `ray start` runs here).")
    ] = False,
    with_logview: Annotated[
        bool, typer.Option("--with-logview", help="Serve the trajectory and metrics viewer on 127.0.0.1 beside "
                           "the run (port: astuner.logview.port; the URL is printed).")
    ] = False,
) -> None:
    """Train an LLM agent with reinforcement learning (GRPO) from a YAML config.

    Example: astuner --conf tutorial/quickstart/quickstart.yaml --backbone debug astuner.data.train_batch_size=4

    Open a run in the log viewer: astuner logview launcher_record/quickstart

    Evaluate checkpoints (accuracy, pass@k, side by side): astuner eval --conf x.yaml --model base
    --model launcher_record/quickstart/global_step_20

    Merge a LoRA checkpoint into a model folder: astuner export CHECKPOINT --out DIR

    Warm-start a tool agent on made-up tools shaped like its own: astuner warmstart --conf x.yaml

    Check a node before a long job (engine, parity, sync, memory plan): astuner doctor --conf x.yaml

    Serve the model for training over the Tinker API: astuner serve --conf x.yaml (keys: astuner serve-key)
    """
    try:
        _until_sigterm(lambda: run(conf, backbone, list(overrides or []), with_ray=with_ray,
                                   with_logview=with_logview))
    except KeyboardInterrupt:
        print("astuner: interrupted", file=sys.stderr)
        raise typer.Exit(INTERRUPT_EXIT) from None


def _until_sigterm(work):
    """`work()`, which SIGTERM unwinds like Ctrl-C within interrupts.GRACE_S, saying so once (exit 143)."""
    try:
        with sigterm_as_interrupt():
            return work()
    except Terminated:
        print("astuner: terminated (SIGTERM); the engine's processes were stopped", file=sys.stderr)
        raise typer.Exit(TERMINATED_EXIT) from None


def _subcommand_app() -> typer.Typer:
    return typer.Typer(add_completion=False, rich_markup_mode=None,
                       context_settings={"help_option_names": ["-h", "--help"]})


logview_app = _subcommand_app()


@logview_app.command()
def logview(
    path: Annotated[str, typer.Argument(help="A run's folder (its experiment_dir), or a folder of runs.",
                                        show_default=False)],
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1; 0: any free port.")] = 0,
) -> None:
    """Open finished (or running) runs in the log viewer: astuner logview launcher_record/quickstart"""
    from pathlib import Path

    from astuner.logview.app import LogViewServer, find_runs

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"logview: {path} is not a folder; give a run's experiment_dir or a folder of runs.")
    runs = find_runs(folder)
    if not runs:
        raise UserError(f"logview: no run under {folder} (a run's folder holds metrics.jsonl or logview.sqlite).")
    viewer = LogViewServer(folder, port)
    url = viewer.start()  # printed only once it answers
    print(f"astuner: log viewer at {url} ({len(runs)} run(s) under {folder.resolve()}); Ctrl-C stops it",
          file=sys.stderr, flush=True)
    try:
        viewer.wait()
    finally:
        viewer.stop()


eval_app = _subcommand_app()


@eval_app.command()
def evaluate(
    conf: Annotated[str, typer.Option("--conf", "-c", help="The YAML config (its workflow, judge and data).",
                                      show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Config overrides.",
                                                          show_default=False)] = None,
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", help="A checkpoint (launcher_record/<run>/global_step_N) or model folder; repeat to "
        "compare; 'base' is the config's model. Default: the config's model.", show_default=False)] = None,
    baseline: Annotated[str | None, typer.Option(
        "--baseline", "-b", help="The model the others are compared to: its label in the table (or its --model "
        "value); 'all': every pair. Default: the first --model.", show_default=False)] = None,
    all_pairs: Annotated[bool, typer.Option("--all-pairs", help="Compare every pair of models (--baseline all).")]
    = False,
    num_repeat: Annotated[int | None, typer.Option(
        "--num-repeat", "-k", help="Sampled episodes per task for pass@k (0: greedy only). Default: "
        "astuner.rollout.num_repeat.", show_default=False)] = None,
    split: Annotated[str, typer.Option(help="Which tasks: val | train.")] = "val",
    out: Annotated[str | None, typer.Option(help="Folder for eval_tasks.csv, eval_summary.json and eval.log. "
                                            "Default: <experiment_dir>/eval.", show_default=False)] = None,
) -> None:
    """Evaluate models on a config's tasks: greedy accuracy, pass@1..k, tokens, failures; side by side.

    Example: astuner eval --conf tutorial/quickstart/quickstart.yaml --model base
    --model launcher_record/quickstart/global_step_20 --num-repeat 4

    The console shows progress and the table; vLLM's output and the workflows' logs go to eval.log in --out.
    """
    from pathlib import Path

    from astuner.config import load_config
    from astuner.evaluation.runner import ALL_PAIRS, choose_pairs, evaluate as run_eval, table
    from astuner.logs import announce, setup_logging

    if all_pairs and baseline not in (None, ALL_PAIRS):
        raise UserError(f"eval: --all-pairs compares every pair, --baseline {baseline} one model with the others; "
                        "give one of the two")
    baseline = ALL_PAIRS if all_pairs else baseline
    loaded = load_config(conf, list(overrides or []))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    folder = Path(out) if out else Path(loaded.experiment_dir) / "eval"
    models = [None if m == "base" else m for m in (model or ["base"])]
    pairs = choose_pairs(models, baseline)  # a wrong --baseline fails before any model loads
    log_file = setup_logging(folder, "eval.log")
    announce(f"eval: {len(models)} model(s); vLLM's output and the workflows' logs go to {log_file}")

    def progress(desc: str, total: int):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="episode", file=sys.stderr, dynamic_ncols=True)

    reports = _until_sigterm(lambda: run_eval(loaded, models, split=split, num_repeat=num_repeat, out_dir=folder,
                                              progress=progress, baseline=baseline))
    print(table(reports, pairs))
    print(f"astuner: per-task results in {folder / 'eval_tasks.csv'}, summary in {folder / 'eval_summary.json'}, "
          f"log in {log_file}; every episode in the log viewer: astuner logview {folder}", file=sys.stderr)


export_app = _subcommand_app()


@export_app.command()
def export(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder (launcher_record/<run>/global_step_N).",
                                              show_default=False)],
    out: Annotated[str, typer.Option("--out", "-o", help="The folder to write.", show_default=False)],
    base_model: Annotated[str | None, typer.Option(
        "--base-model", help="The base model folder of a LoRA checkpoint. Default: the one its adapter_config.json "
        "names.", show_default=False)] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16.")] = "float32",
    model: Annotated[str, typer.Option(
        "--model", help="Which model of a run of several (astuner.models): policy, or a model's name.")] = "policy",
) -> None:
    """Write a merged Hugging Face model folder from a checkpoint (LoRA adapters merged into their base model).

    Example: astuner export launcher_record/quickstart/global_step_20 --out exported/quickstart
    """
    from pathlib import Path

    from astuner.trainer.lora import export_merged

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"export --dtype {dtype}: use float32, bfloat16 or float16")
    if Path(out).exists() and any(Path(out).iterdir()):
        raise UserError(f"export --out {out}: the folder exists and is not empty; choose a new one")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = Path(checkpoint)
    from astuner.resume import checkpoint_models

    names = checkpoint_models(source)
    if names or model != "policy":  # a checkpoint of several models holds one folder per model
        if model not in names:
            raise UserError(f"export --model {model}: {checkpoint} holds no model of that name; its models are: "
                            f"{', '.join(names or ['policy'])}")
        source = source / model
    try:
        folder = export_merged(source, Path(out), base_model=base_model, dtype=dtype)
    except FileNotFoundError as exc:
        raise UserError(f"export: {exc}") from None
    print(f"astuner: merged model written to {folder}", file=sys.stderr)


warmstart_app = _subcommand_app()


@warmstart_app.command()
def warmstart(
    conf: Annotated[str, typer.Option("--conf", "-c", help="The GRPO config of the agent (its workflow, tasks, "
                                      "model and chat settings).", show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Config overrides (the dry run "
                                                          "and the SFT both get them).", show_default=False)] = None,
    tools: Annotated[str | None, typer.Option(
        "--tools", help="A JSON file with the agent's tools (a list of OpenAI function schemas). Default: read "
        "them from a dry run of the workflow.", show_default=False)] = None,
    count: Annotated[int, typer.Option(help="Demonstrations to write.", min=1)] = 32,
    epochs: Annotated[int, typer.Option(help="SFT passes over them.", min=1)] = 2,
    episodes: Annotated[int, typer.Option("--dry-run-episodes", help="Episodes of the dry run.", min=1)] = 4,
    fresh_dry_run: Annotated[bool, typer.Option(
        "--fresh-dry-run", help="Run the dry run even when an earlier warm start of this config (its folder or a "
        "numbered one beside it) read the tools of the same agent code and rollout settings; by default a rerun "
        "reuses that dry run's tools.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the demonstrations.")] = 0,
    draws: Annotated[int, typer.Option(
        help="Warm starts to try at most: after each SFT a few episodes are sampled on the training tasks and scored "
        "by your judge; when none scores, other demonstrations are drawn (the next seed).", min=1)] = 3,
    chain_share: Annotated[float | None, typer.Option(
        help="Share of the demonstrations that chain two calls (one tool's result passed to another). Default: 0.5 "
        "with several tools, 0 with one.", min=0.0, max=1.0, show_default=False)] = None,
    gather_share: Annotated[float | None, typer.Option(
        help="Share of the demonstrations that call two tools and compute the answer from their numbers (a product "
        "or a sum). Default: 0.5 when most of the judge's answers are numbers the tools did not return (chains then "
        "0.25), else 0.", min=0.0, max=1.0, show_default=False)] = None,
    out: Annotated[str | None, typer.Option(
        help="The warm start's folder: each draw's SFT run in draw_N/, and `model`, a link to the checkpoint kept. "
        "Default: <experiment_dir>_warmstart.", show_default=False)] = None,
) -> None:
    """Warm-start a tool agent: SFT on demonstrations of made-up tools shaped like the agent's own.

    The tools' schemas come from a dry run of the workflow (or --tools FILE); the demonstrations use other tool
    names and values with the same argument shapes and types, so GRPO still has the task to learn. After the SFT,
    episodes sampled on the training tasks check that some score (else other demonstrations are drawn). Prints
    the checkpoint to train from.

    Example: astuner warmstart --conf tutorial/agent_quickstart/agent_quickstart.yaml
    """
    from astuner.offline.warmstart import WarmStartSettings, run_warmstart

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    settings = WarmStartSettings(count=count, epochs=epochs, dry_run_episodes=episodes, seed=seed,
                                 fresh_dry_run=fresh_dry_run, draws=draws, chain_share=chain_share,
                                 gather_share=gather_share)
    result = _until_sigterm(lambda: run_warmstart(
        conf, list(overrides or []), tools, out, settings,
        say=lambda line: print(f"astuner: {line}", file=sys.stderr, flush=True)))
    # stdout: the result, its last line the GRPO command to run next (copied as it is)
    # A warm start is a draw of demonstrations: on a two-tool task some draws left GRPO no reward to compare.
    print(f"astuner: if the GRPO run stops without a learning signal (every episode 0), draw other demonstrations "
          f"with --seed {seed + draws}", file=sys.stderr)
    print(f"astuner: warm start done: checkpoint {result.checkpoint}; train from it (add your --backbone) with:")
    print(result.command)


doctor_app = _subcommand_app()


@doctor_app.command()
def doctor(
    conf: Annotated[str | None, typer.Option("--conf", "-c", help="A run's config: its models are tried with its "
                                             "sampling, trainer and engine settings, and its memory plan shown.",
                                             show_default=False)] = None,
    overrides: Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Config overrides.",
                                                          show_default=False)] = None,
    model: Annotated[str | None, typer.Option(help="The model to try without a config (a folder or demo:NAME). "
                                              "Default: the config's, else demo:smollm2-135m-instruct.",
                                              show_default=False)] = None,
    backbone: Annotated[str, typer.Option(help="The backbone the memory plan is for.")] = "debug",
    quick: Annotated[bool, typer.Option("--quick", help="Skip the checks that load the model (engine start, "
                                        "parity, sync, sleep/train/wake).")] = False,
    parity_tokens: Annotated[int, typer.Option(help="Prompt length of the long-sequence parity check.",
                                               min=16)] = 3000,
    out: Annotated[str | None, typer.Option(help="Folder for doctor.log (vLLM's output) and doctor.json. "
                                            "Default: a new folder under the system's temp dir.",
                                            show_default=False)] = None,
) -> int:
    """Check this node before a long job: versions, devices, /dev/shm, vLLM sleep mode, an engine start,
    long-sequence logprob parity, a verified sync, a sleep -> train step -> wake cycle, and the memory plan of
    --conf. Each line passes, warns, fails (with what to do) or says why it was skipped. Exit 1 if one failed.

    Example: astuner doctor --conf tutorial/quickstart/quickstart.yaml
    """
    import tempfile
    from pathlib import Path

    from astuner.doctor import Context, run_checks, summary, write_json
    from astuner.logs import setup_logging
    from astuner.model_cache import DEMO_PREFIX

    from astuner.config.backbones import backbone as backbone_record

    backbone_record(backbone)  # a UserError naming the backbones for another name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    loaded = None
    if conf:
        from astuner.config import load_config

        # --model with a config is the config's model, changed: every check then builds from one config.
        loaded = load_config(conf, list(overrides or []) + ([f"astuner.model.path={model}"] if model else []))
        model = loaded.typed.astuner.model.path
    elif overrides:
        raise UserError("doctor: KEY=VALUE overrides need --conf (they change a config)")
    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="astuner-doctor-"))
    log_file = setup_logging(folder, "doctor.log")

    import torch

    ctx = Context(device="cuda" if torch.cuda.is_available() else "cpu",
                  model=model or f"{DEMO_PREFIX}smollm2-135m-instruct", loaded=loaded, backbone=backbone,
                  quick=quick, parity_tokens=parity_tokens, log_file=log_file)
    print(f"astuner doctor: {ctx.model} on {ctx.device}; details in {log_file}", file=sys.stderr, flush=True)
    width = 22
    results = run_checks(ctx, lambda check: print(check.line(width), flush=True))
    write_json(results, folder / "doctor.json")
    print(summary(results))
    return 1 if any(r.status == "fail" for r in results) else 0


SUBCOMMANDS = {"logview": logview_app, "eval": eval_app, "export": export_app, "warmstart": warmstart_app,
               "doctor": doctor_app, "serve": serve_app, "serve-key": key_app, "serve-model": serve_model_app}


def _fail(message: str) -> int:
    print(f"astuner: error: {' '.join(str(message).split())}", file=sys.stderr)
    return USAGE_EXIT


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `astuner` console script and of launcher.py. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # `astuner logview PATH` and `astuner eval ...` are further commands; `astuner --conf ...` stays the command
    # line of a run.
    sub = args[0] if args and args[0] in SUBCOMMANDS else None
    command = typer.main.get_command(SUBCOMMANDS[sub] if sub else app)
    prog = "astuner"
    if sub:
        argv, prog = args[1:], f"astuner {sub}"
    try:
        # Not standalone: click would print its own usage errors and Typer would render tracebacks.
        code = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except _CLI_ERRORS as exc:
        # exit_code 2 marks a usage error (missing --conf, unknown option).
        message = exc.format_message().rstrip()
        if not message.endswith((".", "?", "!")):
            message += "."
        hint = " Run 'astuner --help' for usage." if getattr(exc, "exit_code", 1) == USAGE_EXIT else ""
        return _fail(message + hint)
    except UserError as exc:
        code = _fail(str(exc))
        if exc.details:
            print(exc.details, file=sys.stderr)
        return code
    except (TrainingStalled, WorkerLost, StageTimeout, EngineStartError) as exc:
        _fail(str(exc))
        return STALLED_EXIT
    except (KeyboardInterrupt, *_ABORTS):
        print("astuner: interrupted", file=sys.stderr)
        return INTERRUPT_EXIT
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
