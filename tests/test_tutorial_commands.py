"""Every tutorial README's commands, run as written: each README's bash blocks, in order, as one `bash -e` script
from the root of a copy of the repository's tutorials (so `cd tutorial/...`, relative paths and the run folders
the later commands read are the reader's).

Only the size changes, never the text: `astuner` on the PATH is a stand-in that runs the real CLI with a tiny
random model (the demo tokenizer) in place of the demo model, the HF engine, 2 samples per task, 2 tasks per
rolled-out step, 8-token turns, 4 validation tasks and no stop for steps without signal appended to each run,
eval, warm start and serve (a key the command sets itself is left to it); a warm start makes one draw. The start-up
memory check is off (ASTUNER_SKIP_MEMORY_CHECK): what is free depends on the tests running beside. A run trains 2
steps (a tutorial's CI check) unless a later command, or the YAML a later command reads (its model.path aside,
which the stand-in replaces), names its folder's `global_step_N`: such a run keeps its step count, so a command that
reads `launcher_record/<run>/global_step_N` reads what the commands before it wrote. `astuner logview` is started,
its runs read from its JSON API, and stopped. The commands run in children of a fork server that has imported the
CLI once (tests/cli_forkserver.py): the same code, without ~6 s of imports per command.

Lines not run, each with its reason (SKIPPED): the set-up commands (CI's own set-up is them), the placeholders of
a model the reader has, and the tune() script whose full-size run the stand-in cannot shrink (tests/test_tune.py
runs its functions).
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from test_readme_agent import code_blocks

SKIPPED = {
    "pip install ": "set-up: CI's set-up installs every extra",
    "bash scripts/quickstart.sh": "set-up and the full-size quick-start; its next line runs the same YAML",
    "/path/to/": "a placeholder for a model and data the reader has",
    "python tutorial/tune_api/quickstart_tune.py": "tune() at full size (7 min), which a stand-in on the PATH cannot "
                                                    "shrink; tests/test_tune.py runs its workflow and judge",
    "bash scripts/setup_env.sh --test": "set-up: CI's set-up is this command",
    ".venv-vf/bin/astuner": "verifiers' own environment: tests/test_verifiers.py runs the tutorial there, 2 steps",
}
SHRINK = {  # appended to every run and eval unless the command sets the key itself
    "astuner.rollout.engine": "hf",
    "astuner.rollout.num_repeat": "2",
    "astuner.rollout.max_response_length_in_one_turn": "8",
    "astuner.data.max_response_length": "32",
    "astuner.data.val_max_samples": "4",  # a random model scores nothing: 4 validation tasks show the same
    # A random model earns no reward: its steps carry no signal, which would stop a run after a few.
    "astuner.trainer_common.max_idle_steps": "1000",
}
# Appended to runs that roll out (their steps keep their count, each rolls out fewer tasks); a config that trains
# on offline data counts its steps in conversations per step, so its batch is left as written.
SHRINK_ROLLOUTS = {"astuner.data.train_batch_size": "2"}
# Appended to a run whose checkpoints no later command reads (short_runs).
SHRINK_STEPS = {"astuner.trainer_common.total_training_steps": "2"}

STAND_IN = '''#!{python}
"""`astuner` for the tutorial commands' test: the real CLI, smaller (tests/test_tutorial_commands.py)."""
import json, os, subprocess, sys, time, urllib.request

TINY, SHRINK, SHRINK_ROLLOUTS, SHRINK_STEPS, TESTS = (
    {tiny!r}, {shrink!r}, {shrink_rollouts!r}, {shrink_steps!r}, {tests!r})
args = sys.argv[1:]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "short_runs.json")) as f:
    short = args in json.load(f)  # the test's list for this README: runs no later command reads
real = [sys.executable, "-m", "astuner.cli"]
if args[:1] == ["logview"]:
    # A server: start it, read its runs through the JSON API, stop it.
    proc = subprocess.Popen(real + args + ["--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline, url = time.time() + 60, None  # and the test's own deadline, should it print nothing at all
    for line in proc.stdout:
        sys.stderr.write(line)
        if "http://127.0.0.1:" in line:
            url = "http://127.0.0.1:" + line.split("http://127.0.0.1:", 1)[1].split("/")[0].split()[0]
            break
        if time.time() > deadline:
            break
    try:
        if url is None:
            sys.exit("logview printed no address")
        runs = json.load(urllib.request.urlopen(url + "/api/runs", timeout=30))["runs"]
        print("logview runs:", len(runs))
        sys.exit(0 if runs else "logview lists no run")
    finally:
        proc.terminate()
        proc.wait(30)
given = {{a.split("=", 1)[0].lstrip("+") for a in args if "=" in a and not a.startswith("-")}}
if args[:1] in (["eval"], ["warmstart"], ["--conf"], ["-c"], ["serve"]):
    args = [a.replace("demo:smollm2-135m-instruct", TINY) for a in args]
    conf = next((b for a, b in zip(args, args[1:]) if a in ("--conf", "-c")), None)
    offline = conf is not None and os.path.isfile(conf) and "offline_data" in open(conf).read()
    extra = {{k: v for k, v in {{**SHRINK, **({{}} if offline else SHRINK_ROLLOUTS)}}.items() if k not in given}}
    if short:
        extra.update({{k: v for k, v in SHRINK_STEPS.items() if k not in given}})
    if "astuner.model.path" not in given:
        extra["astuner.model.path"] = TINY
    args = args + [f"{{k}}={{v}}" for k, v in extra.items()]
    if args[:1] == ["warmstart"] and not any(a.startswith("--draws") for a in args):
        args.append("--draws=1")  # a random model's draws never score: one shows the command works
if os.environ.get("ASTUNER_TEST_FORKSERVER"):  # the CLI already imported (tests/cli_forkserver.py)
    sys.path.insert(0, TESTS)
    from cli_forkserver import run_client

    code = run_client(os.environ["ASTUNER_TEST_FORKSERVER"], args)
    if code is not None:
        sys.exit(code)
sys.exit(subprocess.call(real + args))
'''


def readme_script(readme: Path) -> tuple[str, list[str]]:
    """The README's bash blocks as one script, and the lines left out (each replaced by a `:` with its reason)."""
    lines, skipped = [], []
    for lang, body in code_blocks(readme.read_text()):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            reason = next((why for key, why in SKIPPED.items() if key in line), None)
            if reason:
                skipped.append(line.strip())
                lines.append(f": skipped, {reason!r}")
            else:
                lines.append(line)
    return "\n".join(lines) + "\n", skipped


def yaml_chain(path: Path) -> list[dict]:
    """A YAML's config and those its Hydra `defaults:` list names (beside it, `_self_` aside), recursively."""
    import yaml

    config = yaml.safe_load(path.read_text()) or {}
    chain = [config]
    for name in config.get("defaults") or []:
        if isinstance(name, str) and name != "_self_" and (path.parent / f"{name}.yaml").is_file():
            chain += yaml_chain(path.parent / f"{name}.yaml")
    return chain


def run_folder(words: list[str], here: Path) -> str:
    """The name of the folder a run writes: astuner.experiment_dir's last part (given, else its YAML's or one it
    builds on), else the YAML's name without .yaml (the default)."""
    given = [w.split("=", 1)[1] for w in words if w.startswith("astuner.experiment_dir=")]
    conf = here / words[1]
    chain = yaml_chain(conf) if conf.is_file() else []
    found = [c["astuner"]["experiment_dir"] for c in chain if (c.get("astuner") or {}).get("experiment_dir")]
    return Path(given[-1] if given else found[0] if found else conf.stem).name


def checkpoints_named(yaml_path: Path, stand_in: bool) -> str:
    """What a YAML (and those it builds on) names; for an `astuner` command, without astuner.model.path, which the
    stand-in replaces unless the command gives it."""
    import yaml

    chain = yaml_chain(yaml_path)
    for config in chain if stand_in else []:
        ((config.get("astuner") or {}).get("model") or {}).pop("path", None)
    return "\n".join(yaml.safe_dump(c) for c in chain)


def short_runs(script: str, cwd: Path) -> list[list[str]]:
    """The arguments of each `astuner --conf` run (not eval, warmstart or serve) that may train 2 steps: no later
    line, and no YAML a later line names, mentions its folder's `<name>/global_step_` (a checkpoint a later command
    reads). Each line's folder follows `cd`; a run named again where it must keep its steps keeps them."""
    parsed, named, here = [], [], cwd  # per line: (its words, its folder); what it names, YAMLs included
    for line in script.splitlines():
        try:
            words = shlex.split(line, comments=True) if line.strip() and not line.startswith(":") else []
        except ValueError:  # unbalanced quotes (a heredoc, an apostrophe): not a run this rule reads
            words = []
        if words[:1] == ["cd"] and len(words) == 2:
            here = here / words[1]
        parsed.append((words, here))
        confs = [here / b for a, b in zip(words, words[1:]) if a in ("--conf", "-c") and (here / b).is_file()]
        named.append("\n".join([line] + [checkpoints_named(c, words[:1] == ["astuner"]) for c in confs]))
    runs, keep = [], []
    for i, (words, here) in enumerate(parsed):
        if words[:1] != ["astuner"] or words[1:2] not in (["--conf"], ["-c"]) or "&" in words or len(words) < 3:
            continue
        mark = f"{run_folder(words[1:], here)}/global_step_"
        (keep if any(mark in text for text in named[i + 1:]) else runs).append(words[1:])
    return [r for r in runs if r not in keep]


def readmes() -> list[Path]:
    return sorted(p for p in (REPO / "tutorial").glob("**/README.md") if "```bash" in p.read_text())


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory, tiny_model_dir):
    """(the stand-in's folder, the scripts' environment): a fork server with the CLI imported serves the
    stand-in's commands (tests/cli_forkserver.py), stopped with the module."""
    # The tiny model with the demo model's position limit (8192): the tutorials' max_model_len stay as written.
    tiny = tmp_path_factory.mktemp("tiny_8k")
    shutil.copytree(tiny_model_dir, tiny, dirs_exist_ok=True)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    folder = tmp_path_factory.mktemp("bin")
    path = folder / "astuner"
    path.write_text(STAND_IN.format(python=sys.executable, tiny=str(tiny), shrink=SHRINK,
                                    shrink_rollouts=SHRINK_ROLLOUTS, shrink_steps=SHRINK_STEPS,
                                    tests=str(REPO / "tests")))
    (folder / "short_runs.json").write_text("[]")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    socket_path = folder / "forkserver.sock"
    env = {**os.environ, "PATH": f"{folder}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", "ASTUNER_TEST_FORKSERVER": str(socket_path),
           # The memory the machine has free depends on the test beside this one (a CPU vLLM engine's KV cache
           # takes up to half of it): the start-up fit is tested on its own figures (test_memory.py), not here.
           "ASTUNER_SKIP_MEMORY_CHECK": "1"}
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_forkserver.py"), str(socket_path)],
                              env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 300)  # its imports: seconds, minutes on a busy CI
        assert ready and server.stdout.readline().strip() == "ready", "the fork server did not start"
        yield folder, env
    finally:
        server.terminate()
        server.wait(60)


def test_readme_script_keeps_every_line_and_says_why_one_is_left_out():
    readme = REPO / "tutorial" / "quickstart" / "README.md"
    script, skipped = readme_script(readme)
    assert skipped == ["bash scripts/quickstart.sh        # from the repository root; or, with .venv set up:"]
    assert "astuner --conf tutorial/quickstart/quickstart.yaml --backbone debug" in script
    assert "set-up and the full-size quick-start" in script


def test_a_run_trains_2_steps_unless_a_later_command_reads_its_checkpoints(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "student.yaml").write_text("astuner:\n  teacher: {path: launcher_record/teacher/global_step_6}\n"
                                                 "  model: {path: launcher_record/warm/global_step_8}\n"
                                                 "  models: {keeper: {path: launcher_record/kept/global_step_2}}\n")
    (tmp_path / "t" / "a.yaml").write_text("astuner:\n  experiment_dir: launcher_record/mine\n")
    (tmp_path / "t" / "u").mkdir()
    (tmp_path / "t" / "u" / "base.yaml").write_text(
        "astuner:\n  models: {m: {path: launcher_record/deep/global_step_3}}\n")
    (tmp_path / "t" / "u" / "child.yaml").write_text("defaults: [base, _self_]\n")
    script = "\n".join([
        "cd t",
        "astuner --conf a.yaml astuner.experiment_dir=launcher_record/warm      # its model.path: the stand-in's",
        "astuner --conf a.yaml astuner.experiment_dir=launcher_record/kept      # another model's path: read",
        "astuner --conf a.yaml                                      # read below, by its YAML's folder",
        "astuner --conf a.yaml astuner.experiment_dir=launcher_record/teacher   # read by student.yaml",
        "astuner --conf a.yaml astuner.experiment_dir=launcher_record/other     # read by no one",
        "astuner eval --conf a.yaml --model launcher_record/mine/global_step_4",
        "astuner --conf a.yaml astuner.experiment_dir=launcher_record/deep      # read by what child.yaml builds on",
        "astuner --conf student.yaml",
        "cd u",
        "astuner --conf child.yaml",
        "echo 'it's",
        ": skipped, 'set-up'",
        "astuner serve --conf a.yaml &"])
    assert short_runs(script, tmp_path) == [["--conf", "a.yaml", "astuner.experiment_dir=launcher_record/warm"],
                                            ["--conf", "a.yaml", "astuner.experiment_dir=launcher_record/other"],
                                            ["--conf", "student.yaml"], ["--conf", "child.yaml"]]


@pytest.mark.slow
@pytest.mark.parametrize("readme", readmes(), ids=lambda p: str(p.relative_to(REPO / "tutorial").parent))
def test_tutorial_readme_commands_run_as_written(readme, tmp_path, stand_in):
    folder, env = stand_in
    root = tmp_path / "repo"
    shutil.copytree(REPO / "tutorial", root / "tutorial",
                    ignore=shutil.ignore_patterns("launcher_record", "__pycache__", "*.png"))
    script, _ = readme_script(readme)
    (tmp_path / "commands.sh").write_text(script)
    (folder / "short_runs.json").write_text(json.dumps(short_runs(script, root)))
    env = {**env, "PYTEST_CURRENT_TEST": os.environ.get("PYTEST_CURRENT_TEST", "")}
    # Its own session, output to a file: a server the README starts with `&` outlives the script (and would hold a
    # pipe open); it is stopped with the session.
    log = tmp_path / "commands.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", str(tmp_path / "commands.sh")], cwd=root, env=env,
                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    out = log.read_text()
    assert proc.returncode == 0, textwrap.shorten(script, 2000) + "\n---\n" + out[-6000:]
    # Each run wrote its checkpoints: a run that trained nothing is no proof.
    for line in script.splitlines():
        match = re.match(r"\s*astuner --conf (\S+)", line)
        if match and "experiment_dir=" not in line:
            assert list(root.glob(f"**/launcher_record/{Path(match.group(1)).stem}/global_step_*")), line
