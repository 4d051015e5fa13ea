"""The inference engine interface: every rollout goes through it (in-process HF, or vLLM in its own process)."""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

from astuner.types import GenerateResult, PromptLogprobs, SamplingParams, SyncReport


class FolderWeights:
    """`base_weights` of an engine whose weights live in another process: its model folder's safetensors."""

    model_path: str

    def base_weights(self) -> dict:
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(self.model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.model_path} holds no *.safetensors files to read its base weights from")
        return {n: t for f in files for n, t in load_file(str(f)).items()}


@runtime_checkable
class InferenceEngine(Protocol):
    kind: str  # its astuner.rollout.engine setting: "hf" or "vllm"
    honours_seed: bool  # whether SamplingParams.seed makes a request's samples repeatable

    device_type: str  # where it computes: "cuda" or "cpu"

    def base_weights(self) -> dict:
        """The weights it served when built, on the CPU, under the names `load_weights` takes (a server switching
        between snapshots serves the base again from them)."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate one continuation. Concurrent calls may be batched by the engine."""

    def abort(self, request_id: str) -> None:
        """Stop a pending request (its caller gets CancelledError); unknown or finished ids are ignored."""

    def load_weights(self, named_tensors: Iterable[tuple[str, object]]) -> SyncReport:
        """Replace the policy weights (names as in the trainer's `named_parameters()`); what the sync did, and
        whether the engine was checked to serve them (also kept as `last_sync`)."""

    def prompt_logprobs(self, token_ids: list[int], topk: int = 0) -> PromptLogprobs:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 under the weights served (untempered), and with `topk` the
        k likeliest tokens at each of those positions."""

    def sleep(self) -> None:
        """Release accelerator memory before a train step (the next load_weights takes it back); may do nothing."""

    def shutdown(self) -> None:
        """Release threads and memory."""
