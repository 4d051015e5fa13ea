"""What every doctor check returns (`Check`) and shares (`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("pass", "warn", "fail", "skip")
GIB = 2**30

# What astuner is tested against; another version is a warning (it may work), not a failure.
TESTED = {"torch": "2.13", "vllm": "0.32", "ray": "2.60", "transformers": "5."}
SHM_DOCKER_DEFAULT = 64 * 2**20
SHM_LEAST = 1 * GIB  # below this even the demo model's weights barely pass through


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # one of STATUSES
    seen: str  # what the check found
    todo: str = ""  # warn/fail: what to do; skip: why it was skipped
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)  # numbers for --json (parity, seconds, bytes)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown check status {self.status!r}")

    def line(self, width: int) -> str:
        pad = f"\n  {'':<4}  {''.ljust(width)}  "
        lines = [line.strip() for line in self.seen.splitlines() if line.strip()] or [""]
        text = f"  {self.status.upper():<4}  {self.name.ljust(width)}  " + pad.join(lines)
        if self.todo:
            text += f"{pad}-> {self.todo}"
        return text


@dataclass
class Context:
    """What the checks share: the device, the model to try, and the objects one check builds for the next."""

    device: str
    model: str  # a local folder or demo:NAME
    loaded: object = None  # the --conf config (config.load_config), for its memory plan
    backbone: str = "debug"
    quick: bool = False  # skip the checks that load the model
    parity_tokens: int = 3000
    log_file: Path | None = None
    built: dict = field(default_factory=dict)  # model_path, engine, trainer, ...


