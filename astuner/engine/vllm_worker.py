"""Runs inside vLLM's worker process (named by `worker_extension_cls`, vLLM's extension point for RL weight
updates): loads the trainer's weights from a shared-memory file in place.

Imported by vLLM in its own process only; nothing here runs in astuner's process.
"""

from __future__ import annotations

import time


class WeightSyncExtension:
    """Mixed into vLLM's worker class; methods are called through `collective_rpc(name, ...)`."""

    _astuner_buffers: dict | None = None

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

        self.model_runner.reload_weights(weights_iterator=weights())
        _repack_tied_head(self.model_runner.get_model())
        return time.perf_counter() - started


    def astuner_fingerprint(self) -> tuple[dict, list[str]]:
        """The fingerprint of the weights this worker serves (astuner/engine/fingerprint.py), and the groups it
        cannot see: vLLM's CPU backend repacks linear weights into oneDNN handles and leaves the parameters
        empty."""
        from astuner.engine.fingerprint import fingerprint, group_of

        params = list(self.model_runner.get_model().named_parameters())
        opaque = sorted({group_of(name) for name, p in params if p.numel() == 0})
        return fingerprint((n, p) for n, p in params if p.numel() > 0), opaque


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
