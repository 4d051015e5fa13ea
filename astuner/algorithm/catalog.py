"""What each `trainer_common.algorithm.type` is: the one place that knows what "grpo" or "dpo" means.

Every module that behaves differently per algorithm type reads its record here instead of comparing the name:
the set-up (reference model, optimizer steps), the preflight plan, the loop's selection policy, the backbone
choice (offline types run in one process), the offline data reader and the config's applicability rules.

Pure data and stdlib only: `astuner.config` reads it, and the config imports no torch.

Adding a type: a record below, its name in the config's `Literal` (a test checks they agree), and, if it needs
one, a selection policy (`astuner/selection.py`, `SELECTIONS`) and an objective (`astuner/algorithm/objectives.py`
or `preference.py`); docs/architecture.md names the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ALGO = "astuner.trainer_common.algorithm."


@dataclass(frozen=True)
class AlgorithmType:
    """One algorithm type.

    data        where a step's batch comes from: "rollouts" (episodes of the workflow), "conversations"
                (offline_data rows with `messages`) or "pairs" (offline_data rows with prompt/chosen/rejected)
    objective   the trainer objective a step trains ("policy", "sft", "dpo", "orpo")
    selection   the loop's selection policy, a key of `astuner.selection.SELECTIONS`
    needs_reference  a frozen copy of the initial policy is kept (DPO's reference); the KL loss adds one to any type
    epochs      optimizer passes over a step's batch: "ppo_epochs" (trainer_common.ppo_epochs), or 1
    mini_batches     the batch is split into trainer_common.mini_batch_num optimizer steps (else one step)
    reads       config keys that act only with this type (the applicability rules and the YAML's "[only ...]")
    """

    name: str
    summary: str
    data: Literal["rollouts", "conversations", "pairs"]
    objective: str
    selection: str
    needs_reference: bool = False
    epochs: Literal["ppo_epochs", "one"] = "one"
    mini_batches: bool = True
    reads: tuple[str, ...] = ()

    @property
    def has_teacher(self) -> bool:
        """Its tokens are scored by astuner.teacher (on-policy distillation: astuner/distill/)."""
        return "astuner.teacher" in self.reads

    @property
    def offline(self) -> bool:
        """Trained on astuner.offline_data: no rollouts, no engine, one process."""
        return self.data != "rollouts"

    def optimizer_steps(self, mini_batch_num: int, ppo_epochs: int) -> int:
        """Optimizer steps one training step takes."""
        return (mini_batch_num if self.mini_batches else 1) * (ppo_epochs if self.epochs == "ppo_epochs" else 1)


ALGORITHMS: dict[str, AlgorithmType] = {
    a.name: a for a in (
        AlgorithmType("grpo", "policy gradient on rollouts with group-relative advantages", "rollouts", "policy",
                      "policy_gradient", epochs="ppo_epochs"),
        AlgorithmType("rft", "SFT on the rollouts whose reward reaches rft_reward_threshold", "rollouts", "sft",
                      "rejection_sampling", reads=(ALGO + "rft_reward_threshold",)),
        AlgorithmType("on_policy_distillation", "policy gradient on rollouts with per-token advantages from a "
                      "teacher's logprobs (reverse KL), optionally plus the reward's", "rollouts", "policy", "distillation",
                      epochs="ppo_epochs", reads=(ALGO + "distill_kl_coef", ALGO + "distill_reward_weight",
                                                  ALGO + "distill_topk", ALGO + "distill_topk_coef",
                                                  ALGO + "distill_teacher_temperature",
                                                  "astuner.teacher")),
        AlgorithmType("sft", "SFT on offline_data conversations", "conversations", "sft", "offline_sft",
                      reads=("astuner.offline_data",)),
        AlgorithmType("dpo", "DPO on offline_data preference pairs", "pairs", "dpo", "offline_pairs",
                      needs_reference=True, mini_batches=False, reads=("astuner.offline_data", ALGO + "beta")),
        AlgorithmType("orpo", "ORPO on offline_data preference pairs (no reference model)", "pairs", "orpo",
                      "offline_pairs", mini_batches=False, reads=("astuner.offline_data", ALGO + "beta")),
    )
}


def algorithm(name: str) -> AlgorithmType:
    """The record of an algorithm type; an unknown name is a ValueError that lists the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm.type {name!r}; available: {', '.join(ALGORITHMS)}") from None


def offline_types() -> tuple[str, ...]:
    return tuple(n for n, a in ALGORITHMS.items() if a.offline)


def types_reading(key: str) -> tuple[str, ...]:
    """The algorithm types under which `key` (or a key below it) acts."""
    return tuple(n for n, a in ALGORITHMS.items() if any(key == r or key.startswith(r + ".") for r in a.reads))


def spoken(names: tuple[str, ...]) -> str:
    """("sft", "dpo", "orpo") -> "sft, dpo or orpo"."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
