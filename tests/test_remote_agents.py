"""Agents that run elsewhere: `astuner serve` runs the training of tutorial/remote_agent/ and client processes
(`astuner.remote`) run its episodes. The tiny model, two steps."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from astuner.serve.remote_board import BoardError, workflow_output
from conftest import REPO

TUTORIAL = REPO / "tutorial/remote_agent"
# The light client install, as a machine that only runs agents has it (scripts/setup_env.sh --test makes it).
LIGHT_PYTHON = REPO / ".venv-remote/bin/python"


def light_python() -> str:
    assert LIGHT_PYTHON.exists(), "no .venv-remote: run `bash scripts/setup_env.sh --test` (it installs clients/remote)"
    return str(LIGHT_PYTHON)


def start_server(tmp_path: Path, model_dir: Path, *overrides: str, port: int = 0,
                 options: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "astuner.cli", "serve", "--conf", str(TUTORIAL / "remote_agent.yaml"), "--port",
           str(port), *options,
           f"astuner.model.path={model_dir}", f"astuner.experiment_dir={tmp_path / 'out'}",
           "astuner.trainer_common.total_training_steps=2", "astuner.data.train_batch_size=2",
           "astuner.rollout.num_repeat=2", "astuner.trainer_common.test_freq=100",
           "astuner.trainer_common.val_before_train=false", "astuner.rollout.max_env_worker=8",
           "astuner.rollout.engine=hf", *overrides]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=log, text=True, start_new_session=True)
    for line in proc.stderr:
        log.write(line)
        log.flush()
        if "remote agents: episodes at " in line:
            url = line.split("episodes at ")[1].split("/astuner/")[0]
            return proc, url
    raise AssertionError(f"astuner serve did not start (exit {proc.wait()}): {(tmp_path / 'server.log').read_text()}")


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        rest = proc.stderr.read()
        return proc.wait(timeout=timeout), rest
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def trajectories(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((out / "trajectories").glob("train_step_*.jsonl"))
            for line in f.read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_client_processes_serve_one_run(tmp_path, tiny_model_dir):
    # The clients start first and wait for the server (as they wait for one that restarts), so both are polling
    # when the first episodes are offered.
    # Both from the light install (clients/remote: no astuner, no torch), as a user's agent machine runs them.
    port = free_port()
    clients = [subprocess.Popen([light_python(), str(TUTORIAL / "agent_client.py"), "--url", f"http://127.0.0.1:{port}",
                                 "--concurrency", "4", "--idle-exit", "120"], stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    proc, url = start_server(tmp_path, tiny_model_dir, port=port)
    code, rest = finish(proc, timeout=300)
    assert code == 0, rest
    counts = []
    for client in clients:
        _, err = client.communicate(timeout=60)  # the server told them the run is over
        assert client.returncode == 0, err
        counts.append(int(err.split("agent_client: ")[1].split()[0]))
    episodes = trajectories(tmp_path / "out")
    assert len(episodes) == 2 * 2 * 2  # steps x tasks x repeats
    assert all(e["calls"] and not e["flags"] and "final_answer" in e["output_metadata"] for e in episodes)
    runners = {e["output_metadata"]["remote_client"] for e in episodes}
    assert 1 <= len(runners) <= 2 and all(r.startswith("local/") for r in runners), runners  # who ran each
    assert all(c >= 1 for c in counts) and sum(counts) >= len(episodes), counts  # both ran episodes
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]


@pytest.mark.slow
def test_a_client_that_vanishes_leaves_its_episode_untrained(tmp_path, tiny_model_dir):
    """One episode is taken and never answered: it times out at its deadline, is flagged and not trained, and its
    late result is refused; the other is run by the same client, with a model call, and trains."""
    from astuner.remote import RemoteClient

    # One validation task (the run validates at its end: the client takes it and vanishes with it too).
    val = tmp_path / "val.jsonl"
    val.write_text((REPO / "tutorial/agent_quickstart/data/val.jsonl").read_text().splitlines()[0] + "\n")
    proc, url = start_server(tmp_path, tiny_model_dir, "astuner.trainer_common.total_training_steps=1",
                             "astuner.data.train_batch_size=1", "astuner.rollout.episode_timeout=6",
                             f"astuner.task_reader.jsonl_dataset_file.validation.file_path={val}",
                             options=("--take-timeout", "6"))
    client = RemoteClient(url, name="flaky", reconnect_s=5)
    held, answered = client.next_episode(wait_s=30), client.next_episode(wait_s=30)
    assert held is not None and answered is not None and 0 < held.deadline_s <= 6
    reply = answered.openai_client(sync=True).chat.completions.create(
        model=answered.model, messages=[{"role": "user", "content": answered.task["query"]}], max_tokens=4)
    assert client.post_result(answered, 1.0, metadata={"final_answer": reply.choices[0].message.content})
    with pytest.raises(Exception, match="has ended"):  # the episode ended: its key takes no more calls
        answered.openai_client(sync=True).chat.completions.create(model="policy", max_tokens=2,
                                                                 messages=[{"role": "user", "content": "hi"}])
    # The client goes on asking, as a client's loop does (taking and dropping the validation episode), so it hears
    # the run's end at once: the server waits at its end for a client that asked lately to be told (`wait_told`).
    def keep_asking() -> None:
        for _ in range(3):
            if not client.run_over:
                client.next_episode(wait_s=30)

    asking = threading.Thread(target=keep_asking)
    asking.start()
    code, rest = finish(proc, timeout=120)
    asking.join(timeout=60)
    assert code == 0, rest
    assert client.run_over
    by_uid = {e["episode_uid"]: e for e in trajectories(tmp_path / "out")}
    timed_out = by_uid[held.episode_uid]
    assert "timeout" in timed_out["flags"] and not timed_out["calls"]
    assert "run by remote client local/flaky" in json.dumps(timed_out), timed_out  # who held it
    assert by_uid[answered.episode_uid]["reward"] == 1.0 and by_uid[answered.episode_uid]["calls"]
    row = json.loads((tmp_path / "out/metrics.jsonl").read_text().splitlines()[0])
    assert row["train/failure_rate"] == 0.5 and row["actor/num_samples"] == 1


@pytest.mark.slow
def test_a_late_or_foreign_result_is_refused(tmp_path, tiny_model_dir):
    from astuner.remote import RemoteClient, RemoteError

    proc, url = start_server(tmp_path, tiny_model_dir, "astuner.data.train_batch_size=1",
                             "astuner.rollout.episode_timeout=4", options=("--take-timeout", "5"))
    try:
        mine, other = RemoteClient(url, name="a", reconnect_s=5), RemoteClient(url, name="b", reconnect_s=5)
        first, second = mine.next_episode(wait_s=30), mine.next_episode(wait_s=30)
        with pytest.raises(RemoteError, match="409.*another client"):
            other.post_result(first, 1.0)
        with pytest.raises(RemoteError, match="400.*reward must be a finite number"):
            mine.post_result(first, "high")
        with pytest.raises(RemoteError, match="400.*unknown result fields"):
            mine.post_result(first, 1.0, score=3)
        second.openai_client(sync=True).chat.completions.create(model=second.model, max_tokens=2,
                                                                messages=[{"role": "user", "content": "hi"}])
        assert mine.post_result(second, 1.0)  # the step trains it and goes on to the next, which nobody takes
        time.sleep(first.seconds_left + 1.0)
        assert mine.post_result(first, 1.0) is False  # past its deadline: 410, not trained
        assert mine.post_error(first, "the agent crashed") is False
    finally:
        code, rest = finish(proc, timeout=120)
    assert code == 1 and "all 2 episodes failed or timed out" in rest, rest  # step 2: nothing to train, it says so
    assert "no remote client took the episode within 5s (astuner serve --take-timeout)" in rest, rest
    assert "Check that remote clients run against this server" in rest  # the clients to look at, not a workflow


@pytest.mark.slow
def test_a_killed_server_resumes_its_last_step_and_the_clients_come_back(tmp_path, tiny_model_dir):
    """SIGKILL mid-run (step 1 saved, step 2's episodes out): the same command resumes from step 1's checkpoint,
    the two client processes reconnect on their own, and every step is trained exactly once."""
    from astuner.remote import RemoteClient
    from astuner.resume import is_complete

    port, out = free_port(), tmp_path / "out"
    clients = [subprocess.Popen([sys.executable, str(TUTORIAL / "agent_client.py"), "--url", f"http://127.0.0.1:{port}",
                                 "--concurrency", "2", "--idle-exit", "240"], stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    overrides = ("astuner.trainer_common.total_training_steps=3", "astuner.trainer_common.save_freq=1")
    proc, url = start_server(tmp_path, tiny_model_dir, *overrides, port=port)
    watcher = RemoteClient(url, reconnect_s=5)
    deadline = time.monotonic() + 240
    while not (is_complete(out / "global_step_1") and watcher.status()["taken"] > 4):  # step 2's episodes are out
        assert proc.poll() is None and time.monotonic() < deadline, "step 2 never started"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = sorted(p.name for p in out.glob("global_step_*") if is_complete(p))
    restarted, _ = start_server(tmp_path, tiny_model_dir, *overrides, port=port)
    code, rest = finish(restarted, timeout=300)
    assert code == 0, rest
    assert f"resuming from {out / saved[-1]}" in rest, rest
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]  # none lost, none trained twice
    names = set()
    for client in clients:
        _, err = client.communicate(timeout=60)  # the restarted server told them the run is over
        assert client.returncode == 0, err
        names.add(f"local/{socket.gethostname()}-{client.pid}")
    after = [json.loads(line) for line in (out / "trajectories/train_step_000003.jsonl").read_text().splitlines()]
    assert after and {e["output_metadata"]["remote_client"] for e in after} <= names  # the same processes


# One client, one episode at a time, each taking about 2.5 s of the 4 s episode_timeout: with four episodes offered
# at once, an episode whose deadline ran from its offer would time out waiting for the client.
SLOW_CLIENT = """
import asyncio, sys
from astuner_remote import RemoteClient

async def slow(episode):
    await asyncio.sleep(2.0)
    await episode.openai_client().chat.completions.create(
        model=episode.model, max_tokens=3, messages=[{"role": "user", "content": episode.task["query"]}])
    return 1.0

print("slow_client:", RemoteClient(sys.argv[1], name="slow", reconnect_s=240).run(slow, concurrency=1,
                                                                                  idle_exit_s=240), file=sys.stderr)
"""


@pytest.mark.slow
def test_a_slow_client_loses_no_episode_and_a_stopped_server_keeps_it_waiting(tmp_path, tiny_model_dir):
    """Four episodes a step, one client that runs one at a time: none times out (each episode's deadline starts
    when the client takes it). SIGTERM after step 1's checkpoint is a stop, not the end of the run: the client keeps
    waiting, and the same command resumes; the run's end is what ends the client."""
    from astuner.remote import RemoteClient
    from astuner.resume import is_complete

    val = tmp_path / "val.jsonl"
    val.write_text((REPO / "tutorial/agent_quickstart/data/val.jsonl").read_text().splitlines()[0] + "\n")
    port, out = free_port(), tmp_path / "out"
    script = tmp_path / "slow_client.py"
    script.write_text(SLOW_CLIENT)
    client = subprocess.Popen([sys.executable, str(script), f"http://127.0.0.1:{port}"], stderr=subprocess.PIPE,
                              text=True)
    overrides = ("astuner.rollout.episode_timeout=4", "astuner.trainer_common.save_freq=1",
                 f"astuner.task_reader.jsonl_dataset_file.validation.file_path={val}")
    proc, url = start_server(tmp_path, tiny_model_dir, *overrides, port=port)
    watcher = RemoteClient(url, reconnect_s=5)
    deadline = time.monotonic() + 240
    while not (is_complete(out / "global_step_1") and watcher.status()["taken"] > 4):  # step 2 under way
        assert proc.poll() is None and time.monotonic() < deadline, "step 2 never started"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    time.sleep(3.0)
    assert client.poll() is None, client.stderr.read()  # not told the run is over: it waits for the server
    restarted, _ = start_server(tmp_path, tiny_model_dir, *overrides, port=port)
    code, rest = finish(restarted, timeout=300)
    assert code == 0, rest
    _, err = client.communicate(timeout=60)
    assert client.returncode == 0 and "slow_client:" in err, err
    episodes = trajectories(out)
    assert episodes and all(not e["flags"] for e in episodes), [e["flags"] for e in episodes]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]


@pytest.mark.slow
def test_a_remote_multi_agent_system_calls_each_agents_model(tmp_path, tiny_model_dir):
    """An episode carries a key per agent of astuner.agents: a call under the critic's key is the critic's, served
    and trained on its own model; the main key stays the policy's."""
    import shutil

    from astuner.remote import RemoteClient, RemoteEpisode

    critic = tmp_path / "critic_model"
    shutil.copytree(tiny_model_dir, critic)
    proc, url = start_server(tmp_path, tiny_model_dir, "astuner.trainer_common.total_training_steps=1",
                             "astuner.data.train_batch_size=1", f"+astuner.models.critic.path={critic}",
                             "+astuner.agents.critic.model=critic")

    async def two_agents(episode):
        for agent in (None, "critic"):
            await episode.openai_client(agent=agent).chat.completions.create(
                model=episode.model, max_tokens=3, messages=[{"role": "user", "content": episode.task["query"]}])
        return 1.0

    RemoteClient(url, name="team", reconnect_s=5).run(two_agents, concurrency=2, idle_exit_s=60)
    code, rest = finish(proc, timeout=120)
    assert code == 0, rest
    for episode in trajectories(tmp_path / "out"):
        assert [(c["agent"], c["model"]) for c in episode["calls"]] == [("", "policy"), ("critic", "critic")]
    with pytest.raises(KeyError, match="'writer' is not in the served run's astuner.agents .listed: critic"):
        RemoteEpisode("ep", {}, url, "k", "policy", 1.0, agent_keys={"critic": "k2"}).key_for("writer")


def test_results_are_checked_before_they_reach_the_run():
    assert workflow_output({"reward": 1, "metadata": {"a": 1}}).reward == 1.0
    assert workflow_output({}).reward is None  # the judge scores it
    for body, words in [({"reward": True}, "reward must be a finite number"), ({"metrics": {"x": "1"}}, "numbers"),
                        ({"reward": float("nan")}, "finite"), ({"agent_rewards": {"a": float("inf")}}, "finite"),
                        ({"is_success": "yes"}, "is_success"), ({"extra": 1}, "unknown result fields"),
                        ([1], "JSON object")]:
        with pytest.raises(BoardError, match=words):
            workflow_output(body)


def test_the_client_installs_alone():
    """The light install holds the client and the tutorial's agent, and neither astuner nor torch; in the full
    install `astuner.remote` is the same client, imported without torch."""
    code = (f"import sys, importlib.util; sys.path.insert(0, {str(REPO / 'tutorial/agent_quickstart')!r}); "
            "import astuner_remote, lookup_agent; "
            "found = [m for m in ('astuner', 'torch', 'transformers') if importlib.util.find_spec(m)]; "
            "assert not found, found")
    subprocess.run([light_python(), "-c", code], check=True, cwd="/")  # not the repository: its astuner/ is there
    code = ("import sys; import astuner.remote, astuner_remote; assert astuner.remote.RemoteClient is "
            "astuner_remote.RemoteClient; heavy = [m for m in ('torch', 'vllm', 'ray', 'transformers') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
