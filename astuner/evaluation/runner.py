"""`astuner eval`: the workflow and judge of a config, run on a split with one or more models.

Per model: one greedy episode per task (accuracy) and, with K > 0, K episodes per task sampled at
`rollout.temperature` (pass@1 ... pass@K, `metrics.py`). Writes `eval_tasks.csv` (one row per model and task) and
`eval_summary.json`; prints the models side by side, and the paired difference of each pair compared (every model
against the baseline: `--baseline NAME`, the first by default, or every pair: `--all-pairs`) with a 95% interval
over tasks. Same rollout code as training (`RolloutRunner`), so an eval number means what the
validation number of a run means.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from astuner.algorithm.pass_at_k import TaskResult, ks_for, paired_difference, summarize, task_results
from astuner.auxiliary import auxiliary_pool
from astuner.config.derived import run_facts
from astuner.engine.build import build_engine
from astuner.errors import UserError
from astuner.monitor.metrics import void_note
from astuner.task_judge.loading import build_judge
from astuner.workflow import load_workflow

log = logging.getLogger(__name__)
SPLITS = ("val", "train")
ALL_PAIRS = "all"  # --baseline all: every pair of models


@dataclass
class ModelReport:
    label: str
    path: str
    tasks: list[TaskResult]
    summary: dict[str, float]
    void: str | None = None  # why its greedy episodes measured nothing (monitor.void_note); its accuracy is n/a


@dataclass
class Difference:
    """`model` minus `baseline`, paired over tasks: {metric: [mean difference, low, high]} (95% interval)."""

    model: str
    baseline: str
    metrics: dict[str, list[float]]

    @property
    def name(self) -> str:
        return f"{self.model} - {self.baseline}"


def model_label(spec: str | None, taken: set[str]) -> str:
    if spec is None:
        return "base"
    path = Path(spec)
    label = path.name if not path.name.startswith("global_step_") else f"{path.parent.name}/{path.name}"
    while label in taken:
        label += "'"
    return label


def model_labels(models: Sequence[str | None]) -> list[str]:
    """The label of every model, in order (a repeated one gets a prime: `x`, `x'`)."""
    labels: list[str] = []
    for spec in models:
        labels.append(model_label(spec, set(labels)))
    return labels


def choose_pairs(models: Sequence[str | None], baseline: str | None = None) -> list[tuple[str, str]]:
    """The (baseline, model) label pairs to compare. `baseline` None: every later model against the first;
    'all': every model against every earlier one; else the model of that label (or that --model value, 'base' for
    the config's model) against each other one. An unknown name is a UserError listing the models."""
    labels = model_labels(models)
    if baseline is None:
        return [(labels[0], label) for label in labels[1:]]
    if baseline == ALL_PAIRS:
        return [(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]]
    given = ["base" if spec is None else spec for spec in models]
    if baseline in labels:
        base = baseline
    elif baseline in given:
        base = labels[given.index(baseline)]
    else:
        raise UserError(f"eval --baseline {baseline}: no such model; the models are {', '.join(labels)} (give one "
                        f"of these, or --all-pairs to compare every pair)")
    return [(base, label) for label in labels if label != base]


def evaluate(loaded, models: list[str | None], split: str = "val", num_repeat: int | None = None,
             out_dir: Path | None = None, progress=None, baseline: str | None = None) -> list[ModelReport]:
    """Run the evaluation of every model in `models` (None: the config's model); write and return the reports.
    `baseline`: which pairs the written summary compares (`choose_pairs`), checked before any model runs."""
    from astuner.runtime import quiet_library_progress
    from astuner.task_reader import build_task_reader

    if split not in SPLITS:
        raise UserError(f"eval --split {split!r}: choose one of {', '.join(SPLITS)}")
    pairs = choose_pairs(models, baseline)
    typed = loaded.typed
    k_samples = typed.astuner.rollout.num_repeat if num_repeat is None else num_repeat
    if k_samples < 0:
        raise UserError(f"eval --num-repeat {k_samples}: give 0 (greedy only) or more")
    workflow_cls = load_workflow(loaded)
    judge = build_judge(loaded)
    reader = build_task_reader(typed, loaded.config_dir)
    tasks = reader.validation_tasks() if split == "val" else reader.training_tasks()
    if not tasks:
        raise UserError(f"eval: the config has no {'validation' if split == 'val' else 'training'} tasks; set the "
                        "task reader's validation file or split, or pass --split train")
    quiet_library_progress()
    ks = ks_for(k_samples) if k_samples > 0 else []
    auxiliary = auxiliary_pool(typed)  # frozen helpers (an LLM judge...): loaded once for every model
    reports: list[ModelReport] = []
    try:
        for spec in models:
            reports.append(_evaluate_model(loaded, spec, reports, tasks, k_samples, ks, workflow_cls, judge,
                                           auxiliary, progress, out_dir))
    finally:
        if auxiliary is not None:
            auxiliary.shutdown()
    if out_dir is not None:
        write_reports(reports, out_dir, split, k_samples, pairs)
    return reports


def _evaluate_model(loaded, spec, reports, tasks, k_samples, ks, workflow_cls, judge, auxiliary,
                    progress, out_dir: Path | None = None) -> ModelReport:
    """One model: its engine, the greedy and sampled episodes (kept for the log viewer in
    `out_dir/episodes/<label>/`), its report."""
    from astuner.rollout import RolloutRunner, RolloutSettings
    from astuner.model_tuner.roster import roster_of
    from astuner.runtime import model_set, stop_token_ids

    typed = loaded.typed
    label = model_label(spec, {r.label for r in reports})
    path, max_len, tokenizer, engine = load_model(typed, spec, "eval")
    models = model_set(typed)
    name = run_facts(typed).engine
    engines = {models.first.name: engine, **{model: build_engine(typed, other, tokenizer, max_len, engine=name)
                                             for model, other in _other_model_paths(models, spec, path).items()}}
    runner = RolloutRunner(RolloutSettings.from_config(typed, max_len), engine, tokenizer, workflow_cls, judge,
                           stop_token_ids(path, tokenizer), config=loaded.cfg, auxiliary=auxiliary,
                           roster=roster_of(typed.astuner.agents, models, engines))
    start = time.perf_counter()
    try:
        bar = progress(f"eval {label}", len(tasks) * (1 + k_samples)) if progress else None
        done = (lambda _: bar.update(1)) if bar is not None else None
        greedy = runner.run(tasks, validation=True, on_episode_done=done)
        sampled = runner.run(tasks, validation=True, sampled_repeats=k_samples, on_episode_done=done,
                             step=1) if k_samples else []
        if bar is not None:
            bar.close()
    finally:
        runner.close(auxiliary=False)  # the pool serves the next model too
        for e in engines.values():
            e.shutdown()
    if out_dir is not None:
        keep_episodes(Path(out_dir) / "episodes" / label.replace("/", "_"), greedy, sampled, tokenizer)
    results = task_results(greedy, sampled, ks)
    summary = summarize(results, greedy + sampled, ks)
    summary["seconds"] = time.perf_counter() - start
    log.info("eval %s: %s", label, json.dumps(summary))
    void = void_note(greedy)
    if void:
        from astuner.logs import announce

        announce(f"eval {label}: void: {void}; its accuracy is n/a (no measurement). Fix what stopped the episodes "
                 "(the log names each), then evaluate again.")
    return ModelReport(label, str(path), results, summary, void)


def checked_model_path(typed, spec: str | None, command: str) -> str:
    """The folder of `spec` (a checkpoint or model folder; None: the config's model), or a UserError of `command`
    saying what it is instead (a LoRA adapter to merge first, a folder with no model)."""
    from astuner.model_cache import ModelPathError, resolve_model_path
    from astuner.trainer.lora import is_adapter_checkpoint

    try:
        path = resolve_model_path(spec if spec is not None else typed.astuner.model.path)
    except ModelPathError as exc:
        raise UserError(f"{command} --model {spec}: {exc}") from None
    if spec is not None and is_adapter_checkpoint(Path(path)):
        raise UserError(f"{command} --model {spec}: a LoRA adapter checkpoint; merge it first with 'astuner export "
                        f"{spec} --out DIR' and give DIR")
    if spec is not None and not (Path(path) / "config.json").is_file():
        from astuner.resume import checkpoint_models

        models = checkpoint_models(Path(path))
        if models:
            raise UserError(f"{command} --model {spec}: a checkpoint of several models ({', '.join(models)}); give "
                            f"one model's folder, e.g. {Path(spec) / models[0]}")
        raise UserError(f"{command} --model {spec}: not a model folder (no config.json); give a checkpoint "
                        "(launcher_record/<run>/global_step_N) or a local Hugging Face model folder")
    return path


def load_model(typed, spec: str | None, command: str):
    """(folder, max_model_len, tokenizer, engine) of `spec` (None: the config's model), as a run samples it."""
    from astuner import preflight
    from astuner.runtime import load_tokenizer

    path = checked_model_path(typed, spec, command)
    max_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len, preflight.read_model_facts(path),
                                              typed.astuner.rollout.max_response_length_in_one_turn)
    tokenizer = load_tokenizer(path)
    return path, max_len, tokenizer, build_engine(typed, path, tokenizer, max_len, engine=run_facts(typed).engine)


def _other_model_paths(models, spec: str | None, path: str) -> dict[str, str]:
    """The folders of the run's other models (`ModelSet` `models` but its first) for one evaluated model: a
    checkpoint's own `<checkpoint>/<name>/` where it has one (a run of several models), else the config's path,
    said on the console."""
    from astuner.logs import announce

    out = {}
    for name, configured in ((s.name, s.folder) for s in models.models[1:]):
        own = Path(path) / name
        if spec is not None and (own / "config.json").is_file():
            out[name] = str(own)
        else:
            if spec is not None:
                announce(f"eval --model {spec}: it holds no folder {name}/, so model {name} is "
                         f"astuner.models.{name}.path ({configured})")
            out[name] = configured
    return out


def keep_episodes(folder: Path, greedy: list, sampled: list, tokenizer) -> None:
    """The episodes of one model where `astuner logview <eval folder>` opens them: split "greedy" and "sampled"."""
    from astuner.logview.records import episode_records
    from astuner.logview.store import StepWriter

    folder.mkdir(parents=True, exist_ok=True)
    store = StepWriter(folder)
    try:
        store.write("greedy", 0, episode_records(greedy, None, tokenizer))
        if sampled:
            store.write("sampled", 0, episode_records(sampled, None, tokenizer))
    finally:
        store.close()


def comparisons(reports: list[ModelReport], pairs: list[tuple[str, str]] | None = None) -> list[Difference]:
    """The paired difference of each (baseline, model) pair (default: every later model against the first)."""
    by_label = {r.label: r for r in reports}
    if pairs is None:
        pairs = [(reports[0].label, r.label) for r in reports[1:]]
    out = []
    for base_label, label in pairs:
        base, other = by_label[base_label], by_label[label]
        if [r.task_id for r in other.tasks] != [r.task_id for r in base.tasks]:
            raise RuntimeError("models were evaluated on different tasks")
        per_task = {"greedy/success_rate": lambda r: float(r.greedy_success),
                    "greedy/reward_mean": lambda r: r.greedy_reward}
        if any(r.samples for r in base.tasks):
            per_task["sampled/pass@1"] = lambda r: r.pass_at.get(1, 0.0)
        out.append(Difference(label, base_label, {
            name: list(paired_difference([fn(r) for r in base.tasks], [fn(r) for r in other.tasks]))
            for name, fn in per_task.items()}))
    return out


def table(reports: list[ModelReport], pairs: list[tuple[str, str]] | None = None) -> str:
    """The models side by side; a column per pair compared (`comparisons`), with its 95% interval."""
    names = list(dict.fromkeys(k for r in reports for k in r.summary))
    diffs = comparisons(reports, pairs)
    header = ["metric", *[r.label for r in reports], *[f"{d.name} [95% CI]" for d in diffs]]
    rows = [header]
    void = {r.label for r in reports if r.void}
    for name in names:
        measured = not name.startswith(("greedy/", "sampled/"))  # counts and rates stand; scores of a void do not
        row = [name, *[_fmt(r.summary.get(name)) if measured or r.label not in void else "n/a" for r in reports]]
        for d in diffs:
            m = d.metrics.get(name)
            cell = f"{m[0]:+.3f} [{m[1]:+.3f}, {m[2]:+.3f}]" if m else ""
            row.append("n/a" if m and void & {d.model, d.baseline} else cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def write_reports(reports: list[ModelReport], out_dir: Path, split: str, k_samples: int,
                  pairs: list[tuple[str, str]] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ks = sorted({k for r in reports for t in r.tasks for k in t.pass_at})
    with open(out_dir / "eval_tasks.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "task_id", "greedy_reward", "greedy_success", "samples", "successes",
                         "sampled_reward_mean", "tokens_per_episode", *[f"pass@{k}" for k in ks]])
        for r in reports:
            for t in r.tasks:
                writer.writerow([r.label, t.task_id, t.greedy_reward, int(t.greedy_success), t.samples, t.successes,
                                 round(t.sampled_reward_mean, 6), round(t.tokens_per_episode, 2),
                                 *[round(t.pass_at[k], 6) if k in t.pass_at else "" for k in ks]])
    summary = {"split": split, "num_repeat": k_samples,
               "models": [{"label": r.label, "path": r.path, **r.summary, "void": r.void} for r in reports],
               "differences": [{"model": d.model, "baseline": d.baseline, **d.metrics}
                               for d in comparisons(reports, pairs)]}
    (out_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f}" if abs(value) >= 100 or float(value).is_integer() and value > 1 else f"{value:.3f}"

