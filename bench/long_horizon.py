"""Long horizons, measured (tutorial/long_horizon/README.md): per step of each run, training reward and success,
episodes cut at the window, compactions and summary length per episode, and validation reward and success where it
ran; and from the run's log viewer store, how useful its summaries were: the share that kept the failed session's
login (the user's name and session id, the fact the answer needs) and the share that kept all four logins.

    python bench/long_horizon.py --runs tutorial/long_horizon/launcher_record/long_horizon_none \
        tutorial/long_horizon/launcher_record/long_horizon [--png curves.png]

Reads each run folder's metrics.jsonl; runs nothing itself (the README's commands train the runs).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorial" / "long_horizon"

# With task_judge.combine (short_summaries.yaml) the reward is the answer's term plus the summary length's; each
# term is logged apart (train/metrics/reward/<name>), and a column left blank where a run has no such term.
COLUMNS = (("train/reward_mean", "train: reward"), ("train/metrics/reward/answer", "of it, the answer's"),
           ("train/success_rate", "success"), ("rollout/cut/window", "cut at the window"),
           ("rollout/context/compactions", "compactions/ep"), ("rollout/context/summary_length", "summary tokens"),
           ("train/turns_per_episode", "calls/ep"), ("val/reward_mean", "validation: reward"),
           ("val/metrics/reward/answer", "of it, the answer's"), ("val/accuracy", "validation: success"),
           ("val/context/summary_length", "validation: summary tokens"))


def rows_of(folder: Path) -> dict[int, dict]:
    """Each step's metrics, training and validation lines of one step merged."""
    steps: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            steps.setdefault(row["step"], {}).update(row)
    return steps


def _tasks() -> dict[str, dict]:
    """The tutorial's tasks by id: each log's seed, page count and answer."""
    tasks = {}
    for name in ("train", "val"):
        for line in (TUTORIAL / "logs" / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            tasks[row["id"]] = row
    return tasks


def _summaries_kept(conn: sqlite3.Connection, tasks: dict[str, dict]) -> dict[tuple[str, int], dict]:
    """Per (split, step), over the episodes' summary calls: {"kept_answer": share that kept the failed user's
    name and session id, "kept_all": share that kept every login's}."""
    sys.path.insert(0, str(TUTORIAL))
    from log_task import make_log  # noqa: E402 - the tutorial's own task, to know each log's logins

    found: dict[tuple[str, int], list[tuple[bool, bool]]] = {}
    for split, step, task_id, text in conn.execute(
            "SELECT e.split, e.step, e.task_id, c.response_text FROM calls c JOIN episodes e ON c.episode_id = e.id "
            "WHERE c.context = 'summary'"):
        row = tasks[task_id]
        pages, answer = make_log(int(row["seed"]), int(row["pages"]))
        failed = answer.split()[0]  # "<user> <reason>"
        logins = [dict(part.split("=", 1) for part in line.split("login ", 1)[1].split())
                  for line in pages[0].splitlines() if " login " in line]
        pairs = [(login["user"], login["session"]) for login in logins]
        kept = [user in text and session in text for user, session in pairs]
        kept_failed = next(k for (user, _), k in zip(pairs, kept) if user == failed)
        found.setdefault((split, step), []).append((kept_failed, all(kept)))
    return {key: {"kept_answer": sum(a for a, _ in v) / len(v), "kept_all": sum(b for _, b in v) / len(v)}
            for key, v in found.items()}


def _guesses(conn: sqlite3.Connection, tasks: dict[str, dict]) -> dict[tuple[str, int], dict]:
    """Per (split, step): {"successes", "guesses"}, a guess being an episode with a reward (the name's half, or
    all) that never asked for the last page (where the failure is), read from each call's text with the
    tutorial's tool-call format (hermes)."""
    from astuner.model_tuner import get_tool_parser

    parser = get_tool_parser("hermes")
    asked: dict[int, set[int]] = {}
    for episode_id, text in conn.execute("SELECT episode_id, response_text FROM calls"):
        asked.setdefault(episode_id, set()).update(
            int(call.arguments.get("page", 0)) for call in parser.parse(text or "").tool_calls
            if call.name == "read_log" and isinstance(call.arguments, dict))
    out: dict[tuple[str, int], dict] = {}
    for episode_id, split, step, task_id, reward, success in conn.execute(
            "SELECT id, split, step, task_id, reward, success FROM episodes"):
        cell = out.setdefault((split, step), {"successes": 0, "guesses": 0})
        cell["successes"] += bool(success)
        if reward and reward > 0:
            cell["guesses"] += int(tasks[task_id]["pages"]) not in asked.get(episode_id, set())
    return out


def summary_usefulness(folder: Path) -> dict[tuple[str, int], dict]:
    """Per (split, step): what the summaries kept (_summaries_kept), successes, and the rewards that were guesses
    (_guesses). Empty without a log viewer store."""
    store = folder / "logview.sqlite"
    if not store.is_file():
        return {}
    tasks = _tasks()
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    out = _guesses(conn, tasks)
    for key, kept in _summaries_kept(conn, tasks).items():
        out.setdefault(key, {}).update(kept)
    return out


def table(folder: Path) -> str:
    steps = rows_of(folder)
    useful = summary_usefulness(folder)
    extra = ((("train", "kept_answer"), "summaries keeping the answer's login"), (("train", "kept_all"), "all 4"),
             (("train", "guesses"), "rewarded without the last page"),
             (("val", "kept_answer"), "validation: the answer's login"),
             (("val", "successes"), "validation: successes"), (("val", "guesses"), "rewarded without the last page"))
    out = [f"{folder.name}:", "| step | " + " | ".join(label for _, label in COLUMNS + extra) + " |",
           "| --- |" + " --- |" * (len(COLUMNS) + len(extra))]
    for step in sorted(steps):
        cells = ["" if key not in steps[step] else f"{steps[step][key]:.3g}" for key, _ in COLUMNS]
        cells += ["" if key not in useful.get((split, step), {}) else f"{useful[split, step][key]:.3g}"
                  for (split, key), _ in extra]
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(folders: list[Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for folder in folders:
        steps = rows_of(folder)
        for ax, key in zip(axes, ("train/reward_mean", "rollout/cut/window", "rollout/context/summary_length")):
            xs = [s for s in sorted(steps) if key in steps[s]]
            ax.plot(xs, [steps[s][key] for s in xs], marker="o", label=folder.name)
            ax.set(xlabel="step", title=key)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"curves: {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    for folder in args.runs:
        print(table(folder))
    if args.png:
        plot(args.runs, args.png)


if __name__ == "__main__":
    main()
