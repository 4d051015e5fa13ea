"""Runs inside vLLM's worker process (named by `worker_extension_cls`, vLLM's extension point for RL weight
updates): loads the trainer's weights from a shared-memory file in place.

Imported by vLLM in its own process only; nothing here runs in astuner's process.
"""

from __future__ import annotations

import time


class WeightSyncExtension:
    """Mixed into vLLM's worker class; methods are called through `collective_rpc(name, ...)`."""

    _astuner_buffers: dict | None = None

    def astuner_watch_driver(self, driver_pid: int, poll_s: float = 1.0) -> None:
        """End this engine when astuner's process is gone, however it ended (SIGKILL, the kernel's OOM killer):
        vLLM's engine core and this worker outlive a parent killed outright, each holding the model (and the worker
        its KV cache), and would starve the next run. A daemon thread polls the driver; when it is gone, the
        engine core (this worker's parent, checked by its process title) is killed and this worker exits."""
        import os
        import signal
        import threading

        def watch() -> None:
            while _alive(driver_pid):
                time.sleep(poll_s)
            parent = os.getppid()
            if parent not in (1, driver_pid) and "VLLM" in _title(parent):
                try:
                    os.kill(parent, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(1)

        threading.Thread(target=watch, name="astuner-driver-watch", daemon=True).start()

    def astuner_load_shared(self, path: str, manifest: list[tuple[str, str, list[int], int, int]]) -> float:
        """Load weights from `path` (a file in /dev/shm that astuner's trainer rewrote in place) described by
        `manifest` rows (name, dtype, shape, nbytes, offset). Returns the seconds spent here.

        The file is mapped once and kept: each sync reads the same pages the trainer just wrote, no copy through
        a pipe. Weights go through `reload_weights` in checkpoint format, so vLLM's own loaders fuse q/k/v and
        gate/up as at start-up.
        """
        import torch

        started = time.perf_counter()
        total = max(offset + nbytes for _, _, _, nbytes, offset in manifest)
        if self._astuner_buffers is None:
            self._astuner_buffers = {}
        buf = self._astuner_buffers.get(path)
        if buf is None or buf.numel() < total:
            buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            from astuner.engine.shared_weights import pin_host_memory

            pin_host_memory(buf)  # GPU workers: the copy onto the device is DMA
            self._astuner_buffers[path] = buf

        def weights():
            for name, dtype, shape, nbytes, offset in manifest:
                yield name, buf[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)

        from vllm.config import set_current_vllm_config

        # The worker's own reload_weights, not its model runner's: the worker's sets vLLM's current config, which
        # layers and quantization methods read while they load and re-process weights (vllm/v1/worker/gpu_worker.py,
        # Worker.reload_weights; CPUWorker inherits it).
        self.reload_weights(weights_iterator=weights())
        with set_current_vllm_config(self.vllm_config):
            _repack_tied_head(self.model_runner.get_model())
        return time.perf_counter() - started

    def astuner_fingerprint(self) -> dict:
        """The fingerprint of the weights this worker serves (astuner/engine/fingerprint.py), under the
        checkpoint's names (see `served_fingerprint`)."""
        return served_fingerprint(self.model_runner.get_model())


def served_fingerprint(model) -> dict:
    """Fingerprint entries under the checkpoint's names: fused layers (qkv_proj, gate_up_proj: the model's
    `packed_modules_mapping`) are split back by their `output_sizes`, and a padded vocabulary is cut to its real
    rows. Each tensor is reduced in bounded chunks (it runs right after the KV cache wakes).

    A layer that vLLM's CPU backend holds only packed (oneDNN, an empty `weight`) is read back through its own
    kernel (`cpu_linear`) on m one-hot rows: the probe columns of fingerprint.py, exact, so the weights that
    actually compute (LoRA's merged linears among them) are compared. A tied LM head's packed copy is read the
    same way, so a head left with the old weights is caught too."""
    import torch

    from astuner.engine.fingerprint import UNREADABLE, TensorPrint, column_sums, probe_columns, tensor_print

    packed = getattr(model, "packed_modules_mapping", None) or {}
    names = {id(p): n for n, p in model.named_parameters()}  # the first name of each (tied) parameter
    prints: dict[str, TensorPrint] = {}
    seen: set[int] = set()  # a tied parameter (the LM head's weight is the embedding's) is reduced once
    for mod_name, module in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        rows = getattr(module, "org_vocab_size", None)  # vocabulary layers: the rows past it are padding
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = names.get(id(param), f"{mod_name}.{pname}")
            if param.numel() == 0:  # packed away: unreadable unless its kernel reads it back below
                prefix = name[: -len(f"{leaf}.{pname}")]
                for part in packed.get(leaf) or [leaf]:
                    prints[f"{prefix}{part}.{pname}"] = UNREADABLE
                continue
            parts = _split(name, leaf, pname, packed.get(leaf), getattr(module, "output_sizes", None), param)
            for part_name, tensor in parts:
                prints[part_name] = tensor_print(tensor[:rows] if rows is not None else tensor)
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if linear is None or not isinstance(weight, torch.Tensor):
            continue
        in_features = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        if in_features is None:
            continue
        columns = probe_columns(in_features)
        dtype = getattr(module, "params_dtype", weight.dtype)
        one_hot = torch.zeros(len(columns), in_features, dtype=dtype, device=weight.device)
        one_hot[torch.arange(len(columns)), columns] = 1
        with torch.no_grad():
            block = linear(one_hot, weight, None).t()  # (out, m): W[:, J], each entry one exact product
        if rows is not None:
            block = block[:rows]
        name = names.get(id(weight), f"{mod_name}.weight")
        sizes = getattr(module, "output_sizes", None)
        for part_name, part in _split(name, leaf, "weight", packed.get(leaf), sizes, block):
            q, qa = column_sums(part)
            whole = prints.get(part_name)
            whole = None if whole == UNREADABLE else whole
            shape = whole.shape if whole is not None else (part.shape[0], in_features)
            prints[part_name] = TensorPrint(shape, whole and whole.s, whole and whole.a, whole and whole.p, q, qa)
    return prints


def _split(name: str, leaf: str, pname: str, parts: list[str] | None, sizes, tensor):
    """(checkpoint name, rows) of a fused parameter's parts, or [(name, tensor)] for an unfused one."""
    if not parts or not sizes or len(parts) != len(sizes) or sum(sizes) != tensor.shape[0]:
        return [(name, tensor)]
    prefix = name[: -len(f"{leaf}.{pname}")]
    return [(f"{prefix}{part}.{pname}", rows) for part, rows in zip(parts, tensor.split(list(sizes)))]


def _repack_tied_head(model) -> None:
    """A tied LM head shares the embedding's weight but, on backends that pre-pack linear weights (vLLM's CPU
    kernels), keeps its own packed copy: without re-packing, the head still computes with the old weights and the
    update is half applied (logprobs move, but to wrong values)."""
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _title(pid: int) -> str:
    """A process's command line as `ps` shows it (vLLM titles its processes "VLLM::EngineCore", "VLLM::Worker")."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
