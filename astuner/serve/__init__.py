"""`astuner serve`: the YAML's model, trainer and engine behind the Tinker API, on a port.

    app.py              the HTTP endpoints (Starlette): keys and tenants, bodies within their limits, the API's
                        error shapes, a refused request's turn, sessions and their expiry
    app_training.py     the training routes; app_sampling.py the sampling routes; call.py a request as they see it
    futures.py          request ids, long polls, each training client's requests in seq_id order, the tenants in turn
    sessions.py         tenants (a key each), their sessions, the silence after which a session expires
    limits.py           what one tenant may make the server hold (bodies, waiting requests, samples, ranks)
    bases.py            the models served: astuner.model and astuner.models, an engine each
    tinker_service.py   training clients (astuner Trainers), their states and sampler saves
    tinker_data.py      a forward_backward's loss and data, checked, as trainer samples
    saved_states.py     tinker:// paths, their files and whose they are
    provenance.py       what the server sampled, checked against the data said to come from it
    snapshots.py        the weights samplers serve, sampling sessions, the engine's switches between them
    tinker_losses.py    the API's built-in losses as trainer objectives
    tinker_sampling.py  sample / compute_logprobs on the config's engine (HF or vLLM), a tenant's share of it
    wire_proto.py       the API's protobuf messages, by hand
    keys.py             the clients' keys (`astuner serve-key`)
    remote_app.py, remote_board.py   remote agents: the episodes' board and its routes

Nothing here is imported by `astuner --help`; torch loads when the server builds its model.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from astuner.config.derived import gpu_share_per_engine, run_facts
from astuner.errors import UserError

LOOPBACK = "127.0.0.1"


def serve_dir(loaded) -> Path:
    return Path(loaded.experiment_dir) / "serve"


def check_host(host: str, keys) -> None:
    """Another host than loopback only with keys: an open port would hand anyone the model and its trainer."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    keys.required = keys.required or not loopback
    if not loopback and not keys.any():
        raise UserError(f"astuner serve --host {host}: listening beyond this machine needs keys; create one per "
                        f"client first (astuner serve-key create NAME --conf ...), or serve on {LOOPBACK}")


def build_service(loaded, limits=None):
    """The Tinker service of a config: its models (`bases.py`: a tokenizer each now, an engine each
    (rollout.engine) now on vLLM, else at its first sampling request, astuner.model's now); trainers come per
    training client. On CUDA several vLLM engines split rollout.gpu_memory_utilization (vLLM reads it per engine)
    and all start before any client is served: one started later, beside trainers, would find its share taken."""
    import torch

    from astuner import runtime
    from astuner.engine.build import build_engine
    from astuner.serve.bases import served_bases
    from astuner.serve.tinker_service import TinkerService

    runtime.quiet_library_progress()
    typed = loaded.typed
    bases = served_bases(typed)
    share = gpu_share_per_engine(typed, len(bases), torch.cuda.is_available())
    engine = run_facts(typed).engine

    def make_engine(base):
        """The config's engine, as a run builds it; vLLM's context: rollout.max_model_len capped by the model's."""
        limits = [n for n in (typed.astuner.rollout.max_model_len, base.facts.max_position_embeddings) if n]
        return build_engine(typed, base.model_path, base.tokenizer, min(limits) if limits else None, engine=engine,
                            gpu_share=share)

    eager = engine == "vllm"
    for i, base in enumerate(bases.values()):
        base.make_engine = make_engine
        if i == 0 or eager:
            base.get_engine()
    return TinkerService(typed, bases, serve_dir(loaded) / "state", limits)


def serve_summary(service, url: str, keys) -> str:
    """The effective-config block of `astuner serve`: what is served, where, to whom, and the memory it takes."""
    from astuner import preflight
    from astuner.memory import available_memory

    gib = preflight.GIB
    engine = service.engine
    kind, device = engine.kind, engine.device_type
    models = [f"{b.facts.path} ({b.facts.architecture}, {b.facts.num_params / 1e6:.1f}M parameters), served as "
              f"{b.name!r}" + (f" ({', '.join(b.roster)})" if len(service.bases) > 1 else "")
              for b in service.bases.values()]
    P = max(b.facts.num_params for b in service.bases.values())  # a training client's cost on the largest
    engines = sum(4 * b.facts.num_params for b in service.bases.values())
    full, lora = preflight.trainer_bytes(P, "fp32", False), preflight.trainer_bytes(P, "fp32", True)
    most = engines + service.max_training_clients * full
    available = available_memory(device)
    names = keys.names()
    if names:
        access = (f"{len(names)} ({', '.join(names)}): only these; each key reaches only the sessions, training "
                  f"clients, samplers, checkpoints and requests it made")
    elif keys.open_access():
        access = f"none: {LOOPBACK} only, any tml- key accepted (one tenant)"
    else:
        access = (f"none left ({keys.path} exists, every key revoked): every request is refused until one is "
                  f"created")
    rows = [
        *(("model" if i == 0 else "", line) for i, line in enumerate(models)),
        ("engine", f"{kind} on {device}, one per model ("
                   + ("all started now" + (", splitting gpu_memory_utilization" if device == "cuda" else "")
                      if kind == "vllm" else "the first's now, another's at its first sampling request")
                   + "); trainers come with each training client"),
        ("listening", url),
        ("keys", access),
        ("limits", service.limits.rows()),
        ("training clients", f"at most {service.max_training_clients}; each up to {lora / gib:.2f} GiB with LoRA, "
                             f"{full / gib:.2f} GiB full fine-tuning (weights, gradients, AdamW), plus activations"),
        ("memory estimate", f"{engines / gib:.2f} GiB engines; at most {most / gib:.2f} GiB with every client full; "
                            f"available {'unknown' if available is None else f'{available / gib:.1f} GiB'}"),
        ("saved state", str(service.state_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    return "effective config:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def tinker_server(service, keys, host: str = LOOPBACK, port: int = 0, poll_wait_s: float | None = None) -> Server:
    """The Tinker API of `service` on host:port (not started)."""
    from astuner.serve.app import POLL_WAIT_S, TinkerApp

    tinker = TinkerApp(service, keys, POLL_WAIT_S if poll_wait_s is None else poll_wait_s)
    server = Server(tinker.app, keys, host, port, on_stop=tinker.close)
    server.tinker = tinker  # its queues and counts, for the summary at stop and for tests
    return server


class Server:
    """uvicorn serving an ASGI app in a thread (`start`) until `stop`; `on_stop` runs after it stopped."""

    def __init__(self, app, keys, host: str = LOOPBACK, port: int = 0, on_stop=None):
        from astuner.uvicorn_thread import UvicornThread

        check_host(host, keys)
        self.on_stop = on_stop
        self.tinker = None  # the Tinker API app, when it serves one (`tinker_server`)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError as exc:
            raise UserError(f"astuner serve cannot listen on {host}:{port} ({exc.strerror}); choose another --port "
                            f"(0: any free port)") from None
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{self.port}"
        self._uvicorn = UvicornThread(app, self.sock, self.url, "astuner-serve", "astuner serve", timeout_keep_alive=75)

    def start(self, timeout: float = 15.0) -> str:
        return self._uvicorn.start(timeout)

    def wait(self) -> None:
        self._uvicorn.wait()

    def stop(self) -> None:
        self._uvicorn.stop(join_s=30)
        if self.on_stop is not None:
            self.on_stop()
