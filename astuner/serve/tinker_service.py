"""What `astuner serve` does for the Tinker API, apart from HTTP: training clients, snapshots, sampling.

    base model       the YAML's astuner.model and each of astuner.models (`bases.py`), named by `base_model`
    training client  one astuner `Trainer` (LoRA of the asked rank, rank 0: the whole model) on a base model;
                     forward / forward_backward with the built-in losses (`tinker_losses.py`), optim_step with the
                     caller's AdamParams, save_state / load_state (weights, optimizer, step count)
    snapshot         the weights a sampler serves: named ones (`save_weights_for_sampler(name)`) on disk, the
                     ephemeral ones of `save_weights_and_get_sampling_client` in memory (the last two per model),
                     and the base model
    sampler          one engine per base model (HF or vLLM); it switches snapshots between requests (a switch
                     waits for the requests in flight, loads with the verified sync, `engine/fingerprint.py`):
                     `snapshots.py`

Saved states and sampler weights are `tinker://` paths to files under `<experiment_dir>/serve/state/`
(`saved_states.py`), so a restarted server loads what an earlier one saved. Everything belongs to a tenant
(`sessions.py`): a session, its training clients and samplers, a model's saved files. Another tenant's are 404.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from astuner.algorithm.catalog import algorithm
from astuner.serve import provenance
from astuner.serve.bases import ServedBase, base_of, base_of_file
from astuner.serve.futures import NotFound, Outcome, RequestError
from astuner.serve.limits import ServeLimits
from astuner.serve.saved_states import SavedStates
from astuner.serve.sessions import Sessions, tenant_label
from astuner.serve.snapshots import EPHEMERAL_KEPT, Samplers
from astuner.serve.tinker_data import request_data
from astuner.serve.tinker_losses import TinkerLoss
from astuner.serve.wire_proto import ForwardBackwardRequest, forward_backward_output
from astuner.trainer.lora import is_lora_param

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    model_id: str
    trainer: object
    lora_rank: int
    base: ServedBase
    tenant: str
    ephemeral: list[str] = field(default_factory=list)  # its in-memory snapshots, oldest first


class TinkerService:
    def __init__(self, typed, bases: dict[str, ServedBase], state_dir: Path, limits: ServeLimits | None = None):
        self.typed, self.bases = typed, bases
        self.policy = next(iter(bases.values()))  # astuner.model: base_model's default
        self.state_dir = Path(state_dir)
        self.saved = SavedStates(self.state_dir)
        self.limits = limits or ServeLimits()
        self.boot = secrets.token_hex(3)  # session ids of a restarted server never meet an earlier one's
        self.sessions = Sessions(self.boot, self.limits.session_timeout_s)
        self.models: dict[str, ServedModel] = {}
        self.samplers = {name: Samplers(base.get_engine, name) for name, base in bases.items()}  # by base
        self.records = provenance.SampleRecords()
        self._lock = threading.Lock()

    max_training_clients = property(lambda self: self.limits.max_training_clients)

    # astuner.model's, the default base
    model_name = property(lambda self: self.policy.name)
    model_path = property(lambda self: self.policy.model_path)
    tokenizer = property(lambda self: self.policy.tokenizer)
    engine = property(lambda self: self.policy.get_engine())

    # --- sessions and models ---------------------------------------------------------------------------------

    def create_session(self, tenant: str) -> str:
        return self.sessions.create(tenant)

    def new_model_id(self, session_id, model_seq_id: int, tenant: str) -> str:
        """The id of a training client the tenant's session creates (the SDK numbers them per session)."""
        return f"{self.sessions.get(session_id, tenant).session_id}:train:{model_seq_id}"

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": b.name, "trainable": True, "sampleable": True,
                                      "max_context_length": b.facts.max_position_embeddings}
                                     for b in self.bases.values()]}

    def check_base_model(self, name: str | None) -> ServedBase:
        return base_of(self.bases, name)

    def check_creation(self, base_model: str | None, lora: dict | None, optimizer: dict | None) -> int:
        """What a create_model asks, checked before anything is built: its LoRA rank (0: the whole model)."""
        return lora_rank_asked(self.check_base_model(base_model), lora, optimizer, self.limits)

    def create_model(self, model_id: str, base_model: str | None, lora: dict | None, tenant: str,
                     optimizer: dict | None = None) -> Outcome:
        base = self.check_base_model(base_model)
        rank = lora_rank_asked(base, lora, optimizer, self.limits)
        with self._lock:
            if model_id in self.models:  # a retried creation: the client it made
                return Outcome(json={"type": "create_model", "model_id": model_id})
            if len(self.models) >= self.max_training_clients:
                raise RequestError(f"this server holds {len(self.models)} training clients, its limit "
                                   f"(astuner serve --max-training-clients); close a ServiceClient to free one (a "
                                   f"session that stops sending heartbeats frees its own after "
                                   f"{self.limits.session_timeout_s:g} s)")
        trainer = self._new_trainer(base, rank)
        with self._lock:
            self.models[model_id] = ServedModel(model_id, trainer, rank, base, tenant)
        log.info("astuner serve: training client %s of %s on %s (%s)", model_id, tenant_label(tenant), base.name,
                 f"LoRA rank {rank}" if rank else "full model")
        return Outcome(json={"type": "create_model", "model_id": model_id})

    def _new_trainer(self, base: ServedBase, rank: int):
        from astuner.config.model_set import lora_settings
        from astuner.trainer import Trainer
        from astuner.trainer.build import trainer_settings

        settings = trainer_settings(self.typed, algorithm(self.typed.astuner.trainer_common.algorithm.type), 1)
        lora = lora_settings(self.typed.astuner.trainer_common.lora, rank)
        # Plain logprobs (no sampling filter), no reference model: the caller's losses need neither.
        settings = replace(settings, lora=lora, top_k=0, top_p=1.0, reference_model=False, use_kl_loss=False)
        return Trainer(base.model_path, settings)

    def info(self, model_id: str, tenant: str) -> dict:
        model = self.model(model_id, tenant)
        arch = getattr(getattr(model.trainer.model, "config", None), "model_type", "")
        return {"type": "get_info", "model_id": model_id, "is_lora": model.lora_rank > 0,
                "lora_rank": model.lora_rank or None,
                "model_data": {"arch": arch, "model_name": model.base.name, "tokenizer_id": model.base.model_path}}

    def model(self, model_id, tenant: str | None = None) -> ServedModel:
        """The training client (the tenant's, when one is given: 404 for another's, as for none)."""
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None or tenant is not None and model.tenant != tenant:
            raise NotFound(f"no training client {model_id!r} on this server (closed, expired, or made by a server "
                           f"that has since restarted: create one from its saved state, "
                           f"create_training_client_from_state_with_optimizer)")
        if tenant is not None:
            self.sessions.touch(model_id.split(":")[0])
        return model

    def session_models(self, session_id: str) -> list[str]:
        with self._lock:
            return [m for m in self.models if m.startswith(f"{session_id}:")]

    def close_session(self, session_id: str, why: str = "was finished by its client") -> list[str]:
        """Ends the session and frees its training clients and samplers; returns the clients' ids."""
        self.sessions.end(session_id, why)
        with self._lock:
            gone = [m for m in self.models if m.startswith(f"{session_id}:")]
            ephemeral = [uri for m in gone for uri in self.models.pop(m).ephemeral]
        for samplers in self.samplers.values():  # their weights in memory go with them
            samplers.forget(ephemeral, f"{session_id}:")
        return gone

    def save_clients(self, name: str, model_ids: list[str] | None = None) -> list[str]:
        """The training clients' states under `name` (every open one's by default: at shutdown, or a silent
        session's at expiry); their tinker:// paths."""
        paths = []
        for model_id in list(self.models) if model_ids is None else model_ids:
            try:
                paths.append(self.save_state(model_id, name).json["path"])
            except Exception:  # noqa: BLE001 - one client's failure must not lose the others'
                log.exception("astuner serve: could not save %s", model_id)
        return paths

    def create_sampler(self, sampler_id: str, model_path: str | None, base_model: str | None, tenant: str) -> dict:
        if model_path:
            held = (s for s in self.samplers.values() if isinstance(model_path, str) and model_path in s.snapshots)
            samplers = next(held, None)
            if samplers is not None and samplers.snapshots[model_path].tenant != tenant:
                samplers = None  # another tenant's weights in memory: as if absent (its file says the same)
            if samplers is None:
                file = self.saved.file_of(model_path, "sampler_weights", tenant)
                samplers = self.samplers[base_of_file(self.bases, file).name]
                samplers.add(model_path, tenant, file=file)
            samplers.open_session(sampler_id, model_path, tenant)
        else:
            self.samplers[self.check_base_model(base_model).name].open_session(sampler_id, "base", tenant)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def sampler(self, sampler_id, tenant: str) -> tuple[ServedBase, Samplers]:
        """The base and the snapshots of the tenant's sampling session (404 when there is none)."""
        for name, samplers in self.samplers.items():
            if isinstance(sampler_id, str) and samplers.tenant_of(sampler_id) == tenant:
                self.sessions.touch(sampler_id.split(":")[0])
                return self.bases[name], samplers
        raise NotFound(f"no sampling session {sampler_id!r} on this server")

    # --- training ---------------------------------------------------------------------------------------------

    def forward_backward(self, request: ForwardBackwardRequest, tenant: str) -> Outcome:
        model = self.model(request.model_id, tenant)
        vocab = int(model.trainer.model.get_input_embeddings().weight.shape[0])
        data = request_data(request, vocab, model.base.facts.max_position_embeddings)
        reported = provenance.verdict(self.records, tenant, request, self.limits.provenance)
        objective = TinkerLoss(request.loss_fn, data, request.config)
        samples = [d.sample for d in data]
        logprobs: list = [None] * len(samples)
        trainer = model.trainer
        if request.forward_only:
            sums = trainer.forward(samples, objective, logprobs_out=logprobs)
        else:
            sums = trainer.forward_backward(samples, objective, logprobs_out=logprobs)
        arrays = [np.asarray(lp, np.float32) for lp in logprobs]
        metrics = {"loss:sum": sums["loss"], **reported}
        return Outcome(proto=forward_backward_output({"logprobs": arrays}, len(arrays), metrics))

    def optim_step(self, model_id: str, adam: dict, tenant: str) -> Outcome:
        from astuner.trainer.settings import AdamStep

        model = self.model(model_id, tenant)
        try:
            step = AdamStep(lr=float(adam["learning_rate"]), betas=(float(adam.get("beta1", 0.9)),
                            float(adam.get("beta2", 0.95))), eps=float(adam.get("eps", 1e-12)),
                            weight_decay=float(adam.get("weight_decay", 0.0)),
                            grad_clip=float(adam.get("grad_clip_norm", 0.0)) or None)
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"adam_params: {exc}") from None
        result = model.trainer.optim_step(step)
        if not math.isfinite(result["grad_norm"]):
            raise RequestError(f"the gradient norm is {result['grad_norm']}: the step was skipped (the weights and "
                               f"AdamW state are unchanged, the gradients cleared); check the data and the lr")
        return Outcome(json={"metrics": {"grad_norm": result["grad_norm"], "learning_rate": result["lr"]}})

    # --- state ------------------------------------------------------------------------------------------------

    def save_state(self, model_id: str, name: str, tenant: str | None = None) -> Outcome:
        import torch

        model = self.model(model_id, tenant)
        uri, file = self.saved.new_file(model.model_id, model.tenant, "weights", name)
        trainer = model.trainer
        state = trainer.state_dict(optimizer=True)
        # fp32 weights are the model's own (state "model" None); under LoRA the adapter alone is the state
        weights = state["model"] or {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()}
        if trainer.peft is not None:
            weights = {n: t for n, t in weights.items() if is_lora_param(n)}
        tmp = file.with_name(file.name + ".tmp")
        torch.save({**state, "model": weights, "lora_rank": model.lora_rank, "model_name": model.base.name}, tmp)
        tmp.replace(file)  # whole or absent
        return Outcome(json={"type": "save_weights", "path": uri})

    def load_state(self, model_id: str, path: str, optimizer: bool, tenant: str, create: bool = False) -> Outcome:
        import torch

        file = self.saved.file_of(path, "weights", tenant)
        saved = torch.load(file, map_location="cpu", weights_only=False)
        if create:
            self.create_model(model_id, saved.get("model_name"), {"rank": saved["lora_rank"]}, tenant)
            try:
                return self.load_state(model_id, path, optimizer, tenant)
            except Exception:
                self.models.pop(model_id, None)  # a client that could not load holds no slot
                raise
        model = self.model(model_id, tenant)
        if saved["lora_rank"] != model.lora_rank:
            raise RequestError(f"{path} holds LoRA rank {saved['lora_rank']}, this training client has "
                               f"{model.lora_rank}")
        model.trainer.load_state_dict({"model": saved["model"], "optimizer": saved["optimizer"] if optimizer else None,
                                       "optimizer_steps": saved["optimizer_steps"]})
        return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

    def save_for_sampler(self, model_id: str, name: str | None, sampler_id: str | None, tenant: str) -> Outcome:
        from safetensors.torch import save_file

        model = self.model(model_id, tenant)
        samplers = self.samplers[model.base.name]
        named = model.trainer.named_parameters_for_sync()
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named}
        if name is not None:
            uri, file = self.saved.new_file(model.model_id, model.tenant, "sampler_weights", name)
            tmp = file.with_name(file.name + ".tmp")
            save_file(tensors, str(tmp), metadata={"base_model": model.base.name})
            tmp.replace(file)
            samplers.add(uri, tenant, file=file)
            out = {"type": "save_weights_for_sampler", "path": uri}
        else:
            uri = f"{model_id}/ephemeral/{sampler_id}"
            samplers.add(uri, tenant, tensors=tensors)
            model.ephemeral.append(uri)
            while len(model.ephemeral) > EPHEMERAL_KEPT:  # an older sampler's weights are let go
                samplers.snapshots.pop(model.ephemeral.pop(0), None)
            out = {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        if sampler_id is not None:
            samplers.open_session(sampler_id, uri, tenant)
        return Outcome(json=out)


def check_optimizer(optimizer: dict | None) -> None:
    """A training client's optimizer is chosen at its creation: one astuner serve does not step is refused then,
    not at its first optim_step."""
    kind = (optimizer or {}).get("type", "adamw") if isinstance(optimizer, (dict, type(None))) else None
    if kind != "adamw":
        raise RequestError(f"optimizer_config {optimizer!r}: astuner serve trains with AdamW only (adamw); "
                           f"create the training client without an optimizer_config, or with type adamw")


def lora_rank_asked(base: ServedBase, lora: dict | None, optimizer: dict | None, limits: ServeLimits) -> int:
    check_optimizer(optimizer)
    lora = lora or {}
    try:
        rank = int(lora.get("rank", 32))
    except (TypeError, ValueError):
        raise RequestError(f"lora_config.rank must be an integer, got {lora.get('rank')!r}") from None
    unsupported = [k for k in ("train_mlp", "train_attn", "train_unembed") if lora.get(k, True) is not True]
    if unsupported:
        raise RequestError(f"lora_config {', '.join(unsupported)}=false: astuner serve puts adapters on the "
                           f"YAML's trainer_common.lora.target_modules; set them there instead")
    hidden = base.facts.shape.hidden if base.facts.shape is not None else None
    most = min(r for r in (limits.max_lora_rank, hidden) if r)
    if not 0 <= rank <= most:
        raise RequestError(f"lora_config.rank must be 0 (the whole model) to {most} (the server's "
                           f"--max-lora-rank {limits.max_lora_rank}"
                           + (f", the model's hidden size {hidden}" if hidden else "") + f"), got {rank}")
    return rank
