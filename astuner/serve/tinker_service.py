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

Paths are `tinker://<model_id>/weights/<name>` and `tinker://<model_id>/sampler_weights/<name>`, kept under
`<experiment_dir>/serve/`, so a restarted server loads what an earlier one saved.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from astuner.serve.bases import ServedBase, base_of, base_of_file
from astuner.serve.futures import Outcome, RequestError
from astuner.serve.snapshots import EPHEMERAL_KEPT, Samplers
from astuner.trainer.lora import is_lora_param
from astuner.serve.tinker_losses import CONFIG_KEYS, INPUTS, REFUSED, TinkerDatum, TinkerLoss
from astuner.serve.wire_proto import ForwardBackwardRequest, WireDatum, forward_backward_output
from astuner.types import Sample

log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^s[0-9a-f]+-[0-9]+:train:[0-9]+$")


@dataclass
class ServedModel:
    model_id: str
    trainer: object
    lora_rank: int
    base: ServedBase
    ephemeral: list[str] = field(default_factory=list)  # its in-memory snapshots, oldest first


class TinkerService:
    def __init__(self, typed, bases: dict[str, ServedBase], state_dir: Path, max_training_clients: int = 2):
        self.typed, self.bases = typed, bases
        self.policy = next(iter(bases.values()))  # astuner.model: base_model's default
        self.state_dir = Path(state_dir)
        self.max_training_clients = max_training_clients
        self.boot = secrets.token_hex(3)  # session ids of a restarted server never meet an earlier one's
        self._sessions = 0
        self.models: dict[str, ServedModel] = {}
        self.samplers = {name: Samplers(base.get_engine, name) for name, base in bases.items()}  # by base
        self._lock = threading.Lock()

    # astuner.model's, the default base
    model_name = property(lambda self: self.policy.name)
    model_path = property(lambda self: self.policy.model_path)
    tokenizer = property(lambda self: self.policy.tokenizer)
    engine = property(lambda self: self.policy.get_engine())

    # --- sessions and models ---------------------------------------------------------------------------------

    def create_session(self) -> str:
        with self._lock:
            self._sessions += 1
            return f"s{self.boot}-{self._sessions}"

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": b.name, "trainable": True, "sampleable": True,
                                      "max_context_length": b.facts.max_position_embeddings}
                                     for b in self.bases.values()]}

    def check_base_model(self, name: str | None) -> ServedBase:
        return base_of(self.bases, name)

    def create_model(self, model_id: str, base_model: str | None, lora: dict | None) -> Outcome:
        base = self.check_base_model(base_model)
        lora = lora or {}
        rank = int(lora.get("rank", 32))
        unsupported = [k for k in ("train_mlp", "train_attn", "train_unembed") if lora.get(k, True) is not True]
        if unsupported:
            raise RequestError(f"lora_config {', '.join(unsupported)}=false: astuner serve puts adapters on the "
                               f"YAML's trainer_common.lora.target_modules; set them there instead")
        if rank < 0:
            raise RequestError(f"lora_config.rank must be >= 0 (0: the whole model), got {rank}")
        with self._lock:
            if model_id in self.models:  # a retried creation: the client it made
                return Outcome(json={"type": "create_model", "model_id": model_id})
            if len(self.models) >= self.max_training_clients:
                raise RequestError(f"this server holds {len(self.models)} training clients, its limit "
                                   f"(astuner serve --max-training-clients); close a ServiceClient to free one")
        trainer = self._new_trainer(base, rank)
        with self._lock:
            self.models[model_id] = ServedModel(model_id, trainer, rank, base)
        log.info("astuner serve: training client %s on %s (%s)", model_id, base.name,
                 f"LoRA rank {rank}" if rank else "full model")
        return Outcome(json={"type": "create_model", "model_id": model_id})

    def _new_trainer(self, base: ServedBase, rank: int):
        from astuner import runtime
        from astuner.trainer import Trainer

        settings = runtime.trainer_settings(self.typed, 1)
        lora = runtime.lora_settings(self.typed.astuner.trainer_common.lora, rank)
        # Plain logprobs (no sampling filter), no reference model: the caller's losses need neither.
        settings = replace(settings, lora=lora, top_k=0, top_p=1.0, reference_model=False, use_kl_loss=False)
        return Trainer(base.model_path, settings)

    def info(self, model_id: str) -> dict:
        model = self.model(model_id)
        arch = getattr(getattr(model.trainer.model, "config", None), "model_type", "")
        return {"type": "get_info", "model_id": model_id, "is_lora": model.lora_rank > 0,
                "lora_rank": model.lora_rank or None,
                "model_data": {"arch": arch, "model_name": model.base.name, "tokenizer_id": model.base.model_path}}

    def model(self, model_id: str) -> ServedModel:
        try:
            return self.models[model_id]
        except KeyError:
            raise RequestError(f"no training client {model_id!r} on this server (closed, or made by a server "
                               f"that has since restarted: create one from its saved state, "
                               f"create_training_client_from_state_with_optimizer)") from None

    def close_session(self, session_id: str) -> list[str]:
        """Frees the session's training clients; returns their ids."""
        with self._lock:
            gone = [m for m in self.models if m.startswith(f"{session_id}:")]
            ephemeral = [uri for m in gone for uri in self.models.pop(m).ephemeral]
        for samplers in self.samplers.values():  # their weights in memory go with them
            samplers.forget(ephemeral, f"{session_id}:")
        return gone

    def save_open_clients(self, name: str) -> list[str]:
        """Every open training client's state under `name` (at shutdown); their tinker:// paths."""
        paths = []
        for model_id in list(self.models):
            try:
                paths.append(self.save_state(model_id, name).json["path"])
            except Exception:  # noqa: BLE001 - one client's failure must not lose the others'
                log.exception("astuner serve: could not save %s", model_id)
        return paths

    def create_sampler(self, sampler_id: str, model_path: str | None, base_model: str | None) -> dict:
        if model_path:
            held = (s for s in self.samplers.values() if isinstance(model_path, str) and model_path in s.snapshots)
            samplers = next(held, None)
            if samplers is None:
                file = self._file_of(model_path, "sampler_weights")
                if not file.exists():
                    raise RequestError(f"{model_path}: no such sampler weights on this server")
                samplers = self.samplers[base_of_file(self.bases, file).name]
                samplers.add(model_path, file=file)
            samplers.open_session(sampler_id, model_path)
        else:
            self.samplers[self.check_base_model(base_model).name].open_session(sampler_id, "base")
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def sampler(self, sampler_id) -> tuple[ServedBase, Samplers]:
        """The base and the snapshots of a sampling session (a 400 when there is none)."""
        for name, samplers in self.samplers.items():
            if isinstance(sampler_id, str) and sampler_id in samplers.sessions:
                return self.bases[name], samplers
        raise RequestError(f"no sampling session {sampler_id!r} on this server")

    # --- training ---------------------------------------------------------------------------------------------

    def forward_backward(self, request: ForwardBackwardRequest) -> Outcome:
        model = self.model(request.model_id)
        if request.loss_fn in REFUSED:
            raise RequestError(f"loss_fn {request.loss_fn!r}: {REFUSED[request.loss_fn]}")
        if request.loss_fn not in INPUTS:
            raise RequestError(f"loss_fn {request.loss_fn!r} is not one astuner serve knows; it serves "
                               f"{', '.join(INPUTS)}")
        allowed = CONFIG_KEYS.get(request.loss_fn, ())
        extra = sorted(set(request.config) - set(allowed))
        if extra:
            raise RequestError(f"loss_fn_config {extra} does not apply to {request.loss_fn} (it reads "
                               f"{', '.join(allowed) or 'none'})")
        vocab = int(model.trainer.model.get_input_embeddings().weight.shape[0])
        data = [datum_sample(d, i, request.loss_fn, vocab) for i, d in enumerate(request.data)]
        if not data:
            raise RequestError("forward_backward needs at least one datum")
        objective = TinkerLoss(request.loss_fn, data, request.config)
        samples = [d.sample for d in data]
        logprobs: list = [None] * len(samples)
        trainer = model.trainer
        if request.forward_only:
            sums = trainer.forward(samples, objective, logprobs_out=logprobs)
        else:
            sums = trainer.forward_backward(samples, objective, logprobs_out=logprobs)
        arrays = [np.asarray(lp, np.float32) for lp in logprobs]
        return Outcome(proto=forward_backward_output({"logprobs": arrays}, len(arrays), {"loss:sum": sums["loss"]}))

    def optim_step(self, model_id: str, adam: dict) -> Outcome:
        from astuner.trainer.settings import AdamStep

        model = self.model(model_id)
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

    def _path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not _MODEL_ID.match(model_id):
            raise RequestError(f"{model_id!r} is not a training client id of this server")
        if not _NAME.match(name):
            raise RequestError(f"checkpoint name {name!r}: letters, digits, '.', '_' and '-' only (up to 128)")
        return f"tinker://{model_id}/{kind}/{name}", self.state_dir / model_id.replace(":", "_") / kind / name

    def _file_of(self, path: str, kind: str) -> Path:
        text = path if isinstance(path, str) else ""
        match = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", text)
        if match is None or match.group(2) != kind:
            raise RequestError(f"{path!r} is not a tinker://<model_id>/{kind}/<name> path of this server")
        return self._path(match.group(1), kind, match.group(3))[1]

    def save_state(self, model_id: str, name: str) -> Outcome:
        import torch

        model = self.model(model_id)
        uri, file = self._path(model_id, "weights", name)
        file.parent.mkdir(parents=True, exist_ok=True)
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

    def load_state(self, model_id: str, path: str, optimizer: bool, create: bool = False) -> Outcome:
        import torch

        file = self._file_of(path, "weights")
        if not file.exists():
            raise RequestError(f"{path}: no such saved state on this server")
        saved = torch.load(file, map_location="cpu", weights_only=False)
        if create:
            self.create_model(model_id, saved.get("model_name"), {"rank": saved["lora_rank"]})
            try:
                return self.load_state(model_id, path, optimizer)
            except Exception:
                self.models.pop(model_id, None)  # a client that could not load holds no slot
                raise
        model = self.model(model_id)
        if saved["lora_rank"] != model.lora_rank:
            raise RequestError(f"{path} holds LoRA rank {saved['lora_rank']}, this training client has "
                               f"{model.lora_rank}")
        model.trainer.load_state_dict({"model": saved["model"], "optimizer": saved["optimizer"] if optimizer else None,
                                       "optimizer_steps": saved["optimizer_steps"]})
        return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

    def save_for_sampler(self, model_id: str, name: str | None, sampler_id: str | None) -> Outcome:
        from safetensors.torch import save_file

        model = self.model(model_id)
        samplers = self.samplers[model.base.name]
        named = model.trainer.named_parameters_for_sync()
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named}
        if name is not None:
            uri, file = self._path(model_id, "sampler_weights", name)
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(file.name + ".tmp")
            save_file(tensors, str(tmp), metadata={"base_model": model.base.name})
            tmp.replace(file)
            samplers.add(uri, file=file)
            out = {"type": "save_weights_for_sampler", "path": uri}
        else:
            uri = f"{model_id}/ephemeral/{sampler_id}"
            samplers.add(uri, tensors=tensors)
            model.ephemeral.append(uri)
            while len(model.ephemeral) > EPHEMERAL_KEPT:  # an older sampler's weights are let go
                samplers.snapshots.pop(model.ephemeral.pop(0), None)
            out = {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        if sampler_id is not None:
            samplers.open_session(sampler_id, uri)
        return Outcome(json=out)

    # --- sampling ---------------------------------------------------------------------------------------------

def datum_sample(d: WireDatum, index: int, loss_fn: str, vocab: int) -> TinkerDatum:
    """A datum as a trainer sample (prompt x_0, response the targets; `tinker_losses.py`), its inputs checked."""
    n = len(d.tokens)
    needed = ("target_tokens", *INPUTS[loss_fn])
    missing = [k for k in needed if k not in d.inputs]
    extra = sorted(set(d.inputs) - set(needed))
    if missing or extra:
        raise RequestError(f"datum {index}: {loss_fn} takes loss_fn_inputs {', '.join(needed)}"
                           + (f"; missing {', '.join(missing)}" if missing else "")
                           + (f"; not read: {', '.join(extra)}" if extra else ""))
    if n == 0:
        raise RequestError(f"datum {index}: model_input holds no tokens")
    for key in needed:
        if d.inputs[key].shape != (n,):
            raise RequestError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(d.inputs[key].shape)}, "
                               f"model_input {n} tokens (one value per position)")
    targets = [int(t) for t in d.inputs["target_tokens"]]
    if d.tokens[1:] != targets[:-1]:
        raise RequestError(f"datum {index}: target_tokens must be model_input shifted by one (position i predicts "
                           f"token i + 1); astuner serve trains on next-token targets only")
    if any(not 0 <= t < vocab for t in d.tokens + targets[-1:]):
        raise RequestError(f"datum {index}: a token id is outside the vocabulary (0..{vocab - 1})")
    inputs = {k: [float(x) for x in d.inputs[k]] for k in INPUTS[loss_fn]}
    old = inputs.get("logprobs", [0.0] * n)
    sample = Sample([d.tokens[0]], targets, old, 0.0, 1.0, f"datum-{index}")
    return TinkerDatum(sample, inputs)
