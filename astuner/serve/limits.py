"""The bounds of `astuner serve`: what one tenant may make the server hold, and for how long.

Each is a command-line option of `astuner serve` (the summary at start lists them). Past a bound a request is
answered in the API's shape: 413 for a body over its limit, 429 for "not now" (the SDK backs off and sends it
again), 400 for what can never be served (a LoRA rank over the maximum).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeLimits:
    max_training_clients: int = 2  # trainers held at once, every tenant together (each holds its optimizer)
    session_timeout_s: float = 150.0  # a session silent this long expires (the SDK warns after 120 s)
    max_lora_rank: int = 128  # and never over the model's hidden size
    seq_window: int = 64  # a training request at most this far ahead of its client's next one waits
    held_mib: int = 256  # request bodies one training client may hold while they wait for their turn
    pending_samples: int = 256  # sequences one tenant may have waiting or being sampled
    engine_share: int = 16  # of those, the most in the engine at once (the rest wait their turn in the server)
    json_body_bytes: int = 8 << 20
    proto_body_bytes: int = 256 << 20  # a forward_backward chunk: the SDK sends about 5 MB each
    provenance: str = "refuse"  # a datum whose spans disagree with what was sampled: "refuse" or "flag"

    def rows(self) -> str:
        return (f"{self.max_training_clients} training clients; a session expires after {self.session_timeout_s:g} s "
                f"without a heartbeat; LoRA rank <= {self.max_lora_rank}; per training client {self.seq_window} "
                f"requests / {self.held_mib} MiB waiting; {self.pending_samples} pending samples per key; "
                f"bodies <= {self.proto_body_bytes >> 20} MiB (forward_backward), {self.json_body_bytes >> 20} MiB "
                f"(others); provenance spans: {self.provenance}")
