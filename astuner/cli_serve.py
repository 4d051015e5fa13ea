"""`astuner serve`, `astuner serve-key` and `astuner serve-model`: the commands (light imports only; the servers load
torch when they start)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from astuner.errors import UserError


def _app() -> typer.Typer:
    return typer.Typer(add_completion=False, rich_markup_mode=None,
                       context_settings={"help_option_names": ["-h", "--help"]})


serve_app = _app()
key_app = _app()
serve_model_app = _app()


def _say(line: str) -> None:
    print(f"astuner: {line}", file=sys.stderr, flush=True)


HELP = {
    "session_timeout": "Seconds without a heartbeat after which a session expires: its training clients are saved "
                       "(their tinker:// paths logged) and their slots freed. The SDK sends one every 10 s.",
    "max_lora_rank": "The largest LoRA rank a training client may ask for (never over the model's hidden size).",
    "max_pending_samples": "Sequences one key may have waiting or being sampled; more are answered 429 (the SDK "
                           "backs off).",
    "max_held_mib": "MiB of requests one training client may send ahead of its turn; more are answered 429.",
    "provenance": "A datum whose provenance spans disagree with what this server sampled: refuse it, or flag it "
                  "(trained, counted in provenance_mismatch:sum).",
    "take_timeout": "With remote agents: seconds an episode waits for a client to take it (default: 4 x "
                    "rollout.episode_timeout); its episode_timeout starts when it is taken.",
}


@serve_app.command()
def serve(
    conf: Annotated[str, typer.Option("--conf", "-c", help="The YAML config: its model (astuner.model.path), "
                                      "trainer settings and experiment_dir.", show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Config overrides.",
                                                          show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; another than loopback only with keys "
                                      "(astuner serve-key create).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0: any free port.")] = 8000,
    max_training_clients: Annotated[int, typer.Option(help="Training clients held at once, every key together "
                                                      "(each is a trainer with its optimizer state).", min=1)] = 2,
    session_timeout: Annotated[float, typer.Option(help=HELP["session_timeout"], min=1)] = 150.0,
    max_lora_rank: Annotated[int, typer.Option(help=HELP["max_lora_rank"], min=1)] = 128,
    max_pending_samples: Annotated[int, typer.Option(help=HELP["max_pending_samples"], min=1)] = 256,
    max_held_mib: Annotated[int, typer.Option(help=HELP["max_held_mib"], min=1)] = 256,
    provenance: Annotated[str, typer.Option(help=HELP["provenance"])] = "refuse",
    public_url: Annotated[str | None, typer.Option(help="The address remote agents reach this server at (default: "
                                                   "http://HOST:PORT).", show_default=False)] = None,
    take_timeout: Annotated[float | None, typer.Option(help=HELP["take_timeout"], min=1, show_default=False)] = None,
    with_logview: Annotated[bool, typer.Option("--with-logview", help="With remote agents: serve the run's "
                                               "trajectory and metrics viewer on 127.0.0.1, as a run does.")] = False,
) -> None:
    """Serve the config's model for training over the Tinker API (the `tinker` SDK works unchanged), or run the
    config's training with its agents elsewhere.

    Example: astuner serve --conf tutorial/quickstart/quickstart.yaml, then in Python:
    tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-local")

    Ctrl-C stops the server after saving every open training client's state (weights and optimizer) and printing
    its tinker:// path; a restarted server loads it with create_training_client_from_state_with_optimizer.

    With rollout.agentscope_workflow: astuner.serve.remote_board->RemoteAgents, the config's training loop runs
    here and remote clients (astuner.remote.RemoteClient) run its episodes: see tutorial/remote_agent/.
    """
    from astuner.config import load_config
    from astuner.serve import check_host, serve_dir
    from astuner.serve.keys import KeyStore
    from astuner.serve.limits import ServeLimits

    if provenance not in ("refuse", "flag"):
        raise UserError(f"--provenance {provenance!r}: refuse or flag")
    limits = ServeLimits(max_training_clients=max_training_clients, session_timeout_s=session_timeout,
                         max_lora_rank=max_lora_rank, pending_samples=max_pending_samples, held_mib=max_held_mib,
                         provenance=provenance)
    loaded = load_config(conf, list(overrides or []))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    keys = KeyStore(serve_dir(loaded) / "keys.json")
    check_host(host, keys)  # before any model loads
    if loaded.typed.astuner.rollout.agentscope_workflow == REMOTE_WORKFLOW:
        return _serve_remote_agents(conf, list(overrides or []), keys, host, port, public_url, with_logview,
                                    loaded.typed.astuner.rollout.episode_timeout, take_timeout)
    if with_logview:
        raise UserError("serve --with-logview shows a run's episodes: it applies with remote agents "
                        f"(rollout.agentscope_workflow: {REMOTE_WORKFLOW}); a Tinker API client logs its own")
    _serve_tinker(loaded, keys, host, port, limits)


REMOTE_WORKFLOW = "astuner.serve.remote_board->RemoteAgents"


def _serve_tinker(loaded, keys, host: str, port: int, limits) -> None:
    from astuner.interrupts import TERMINATED_EXIT, Terminated, sigterm_as_interrupt
    from astuner.logs import setup_logging
    from astuner.serve import build_service, serve_dir, serve_summary, tinker_server

    log_file = setup_logging(serve_dir(loaded), "serve.log")
    _say(f"loading {loaded.typed.astuner.model.path}; the server's log goes to {log_file}")
    service = build_service(loaded, limits)
    server = tinker_server(service, keys, host, port)
    print(serve_summary(service, server.url, keys), file=sys.stderr)
    _say(f"serving the Tinker API at {server.url}; Ctrl-C saves the open training clients and stops")
    server.start()
    try:
        # SIGTERM stops it as Ctrl-C does, with no deadline: the clients' states are saved
        with sigterm_as_interrupt(grace_s=None):
            server.wait()
    except Terminated:
        _say("terminated (SIGTERM)")
        raise typer.Exit(TERMINATED_EXIT) from None
    finally:
        server.stop()
        for path in service.save_clients("at_shutdown"):
            _say(f"saved {path} (resume with create_training_client_from_state_with_optimizer)")
        for base in service.bases.values():
            if base.engine is not None:
                base.engine.shutdown()


def _serve_remote_agents(conf: str, overrides: list[str], keys, host: str, port: int, public_url: str | None,
                         with_logview: bool, episode_timeout_s: float, take_timeout_s: float | None) -> None:
    """The YAML's training run, its episodes taken by remote clients (`astuner_remote`) from this server. Only a run
    that finished tells the clients it is over: a stop (Ctrl-C, SIGTERM, an error) keeps them waiting for the
    server that resumes it."""
    from astuner.interrupts import TERMINATED_EXIT, Terminated, sigterm_as_interrupt
    from astuner.launch import run
    from astuner.serve import Server
    from astuner.serve.remote_app import MAX_WAIT_S, RemoteApp
    from astuner.serve.remote_board import EpisodeBoard, RemoteAgents

    board = EpisodeBoard(episode_timeout_s=episode_timeout_s, take_timeout_s=take_timeout_s)
    server = Server(RemoteApp(board, keys), keys, host, port)
    if public_url is None and host in ("0.0.0.0", "::"):  # a wildcard is no address a client can call
        import socket

        public_url = f"http://{socket.gethostname()}:{server.port}"
        _say(f"clients are told {public_url}; give --public-url if they reach this machine by another name")
    board.public_url = (public_url or server.url).rstrip("/")
    server.start()
    _say(f"remote agents: episodes at {board.public_url}/astuner/v1/episodes/next, model calls at "
         f"{board.public_url}/v1 (each episode's own key); the run starts now")
    try:
        with sigterm_as_interrupt(grace_s=None):  # no deadline: a stop saves as the same command resumes
            run(conf, "debug", overrides, with_logview=with_logview, workflow=RemoteAgents.on(board))
        board.run_over = True  # the run finished: the clients hear it before the server closes
        board.wait_told(recent_s=MAX_WAIT_S + 10, deadline_s=MAX_WAIT_S + 10)
    except (Terminated, KeyboardInterrupt):
        _say(f"{'terminated (SIGTERM)' if sys.exc_info()[0] is Terminated else 'interrupted'}; the clients keep "
             f"waiting (for up to their reconnect_s); the same command resumes from the last checkpoint")
        raise typer.Exit(TERMINATED_EXIT if sys.exc_info()[0] is Terminated else 130) from None
    finally:
        server.stop()


@key_app.command("create")
def key_create(
    name: Annotated[str, typer.Argument(help="Who the key is for (a client, a machine).", show_default=False)],
    conf: Annotated[str, typer.Option("--conf", "-c", help="The served YAML config.", show_default=False)],
) -> None:
    """Create a client's key; it is printed once (keep it: only its digest is stored)."""
    store = _keys(conf)
    key = store.create(name)
    _say(f"key {name!r} created; the server accepts it at once (and only keys from now on)")
    print(key)


@key_app.command("revoke")
def key_revoke(
    name: Annotated[str, typer.Argument(help="The key's name.", show_default=False)],
    conf: Annotated[str, typer.Option("--conf", "-c", help="The served YAML config.", show_default=False)],
) -> None:
    """Revoke a client's key (a running server refuses it from its next request)."""
    store = _keys(conf)
    left = store.revoke(name)
    _say(f"key {name!r} revoked; {left} left" if left else
         f"key {name!r} revoked; no key is left, so the server refuses every request (it does not reopen to any "
         f"key): create one (astuner serve-key create NAME), or delete {store.path} and serve on 127.0.0.1 to take "
         f"any key again")


@key_app.command("list")
def key_list(conf: Annotated[str, typer.Option("--conf", "-c", help="The served YAML config.",
                                               show_default=False)]) -> None:
    """The names of the keys (the keys themselves are not stored)."""
    for name in _keys(conf).names():
        print(name)


def _keys(conf: str):
    from astuner.config import load_config
    from astuner.serve import serve_dir
    from astuner.serve.keys import KeyStore

    if not os.path.exists(conf):
        raise UserError(f"serve-key: no config at {conf}")
    return KeyStore(serve_dir(load_config(conf, [])) / "keys.json")


@serve_model_app.command()
def serve_model(
    conf: Annotated[str, typer.Option("--conf", "-c", help="The run's YAML config: its chat template, parsers, "
                                      "limits and sampling are served.", show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Config overrides.",
                                                          show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="A checkpoint (launcher_record/<run>/"
                                              "global_step_N) or model folder. Default: the config's model.",
                                              show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; another than loopback only with --key-env.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0: any free port.")] = 8000,
    key_env: Annotated[str | None, typer.Option("--key-env", help="An environment variable holding the key every "
                                                "request must carry (Bearer or x-api-key).", show_default=False)]
    = None,
) -> None:
    """Serve a checkpoint over the OpenAI (Chat Completions, Responses) and Anthropic (Messages) APIs exactly as
    its training rollouts sampled it, for any evaluation harness.

    Example: astuner serve-model --conf tutorial/reasoning_gym/reasoning_gym.yaml
    --model launcher_record/reasoning_gym_chain_sum/global_step_20, then point a client at
    http://127.0.0.1:8000/v1 (temperature 0: greedy, as `astuner eval` measures).
    """
    from pathlib import Path

    from astuner.config import load_config
    from astuner.interrupts import TERMINATED_EXIT, Terminated, sigterm_as_interrupt
    from astuner.logs import setup_logging
    from astuner.serve import LOOPBACK
    from astuner.serve import model_server

    key = None
    if key_env is not None:
        key = os.environ.get(key_env)
        if not key:
            raise UserError(f"serve-model --key-env {key_env}: that environment variable is empty or unset; export "
                            "the key there first (any long random string, e.g. from 'openssl rand -hex 24')")
    elif host not in (LOOPBACK, "localhost", "::1"):
        raise UserError(f"serve-model --host {host}: listening beyond this machine needs a key (--key-env VAR), "
                        f"or serve on {LOOPBACK}")
    loaded = load_config(conf, list(overrides or []))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log_file = setup_logging(Path(loaded.experiment_dir) / "serve_model", "serve-model.log")
    _say(f"loading {model or loaded.typed.astuner.model.path}; the server's log goes to {log_file}")
    app, path, engine = model_server.build(loaded, model)
    app.key = key

    def ready(base_url: str) -> None:
        _say(f"serving {path} at {base_url} (OpenAI Chat Completions and Responses; Anthropic Messages at "
             f"{base_url.removesuffix('/v1')}); model name {app.model_name!r}; "
             "Ctrl-C stops")

    try:
        with sigterm_as_interrupt(grace_s=None):
            model_server.serve(app, host, port, on_ready=ready)
    except Terminated:
        _say("terminated (SIGTERM)")
        raise typer.Exit(TERMINATED_EXIT) from None
    finally:
        app.runner.close(auxiliary=False)
        engine.shutdown()
