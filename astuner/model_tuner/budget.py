"""An episode's limits, and the token budget its calls share.

Before it generates, a call takes its new tokens from the budget (`EpisodeBudget.reserve`):
  min(max_tokens_per_turn, max_model_len - prompt, max_response_tokens - generated - reserved by running calls),
capped by what the request asked for (never below 1); a summary or a sub-agent's report has summary_max_tokens in
the per-turn cap's place. Its reservation goes back when it ends (`release`), and the
tokens of a call the episode un-records leave the budget (`give_back`). A first prompt over max_prompt_length, a
prompt that leaves no room or a budget already spent overflows the episode (`EpisodeOverflow`); a call that finds
what is left reserved by calls still generating waits for them. Each allowance and each refusal names the limit
that set it (astuner/cuts.py: turn_cap, budget, window, prompt, summary_cap), so a cut is never put down to the wrong one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from astuner import cuts
from astuner.model_tuner.turn import EpisodeOverflow


@dataclass
class TunerLimits:
    max_model_len: int  # prompt + response of one call (rollout.max_model_len)
    max_tokens_per_turn: int  # new tokens of one call (rollout.max_response_length_in_one_turn)
    max_response_tokens: int  # new tokens over the whole episode (data.max_response_length)
    max_prompt_length: int  # tokens of the episode's first prompt (data.max_prompt_length)
    context_policy: str = "none"  # what a call that does not fit is shown (rollout.context_policy, context.py)
    summary_max_tokens: int = 256  # new tokens of a summary call (context_policy: summarize)


class EpisodeBudget:
    """The new tokens an episode's calls have generated and reserved, and whether the episode overflowed."""

    def __init__(self, limits: TunerLimits) -> None:
        self.limits = limits
        self.overflowed = False
        self.overflow_reason: str | None = None
        self.overflow_limit = ""  # the limit that refused (astuner/cuts.py)
        self._budget_overflow = False  # overflowed only because the episode's token budget was spent
        self.generated_tokens = 0
        # New tokens promised to calls still generating: parallel calls reserve their share of the episode's
        # budget before generating, so together they never exceed it (`reserve`).
        self._reserved = 0
        self._budget_freed: asyncio.Event | None = None

    def _overflow(self, reason: str, limit: str) -> EpisodeOverflow:
        self.overflowed = True
        self.overflow_reason = reason
        self.overflow_limit = limit
        self._budget_overflow = limit == cuts.BUDGET  # `discard` may hand the budget back, and with it the episode
        return EpisodeOverflow(reason)

    def _max_tokens(self, prompt_len: int, first: bool, turn_cap: int | None = None) -> tuple[int, str]:
        lim = self.limits
        turn_cap = lim.max_tokens_per_turn if turn_cap is None else turn_cap
        if self.overflowed:
            raise EpisodeOverflow(self.overflow_reason or "episode already overflowed")
        if first and prompt_len > lim.max_prompt_length:
            raise self._overflow(f"first prompt has {prompt_len} tokens > max_prompt_length {lim.max_prompt_length}",
                                 cuts.PROMPT)
        budget_left = lim.max_response_tokens - self.generated_tokens
        if budget_left <= 0:
            raise self._overflow(f"episode generated {self.generated_tokens} tokens, budget {lim.max_response_tokens}",
                                 cuts.BUDGET)
        room = lim.max_model_len - prompt_len
        if room <= 0:
            raise self._overflow(f"prompt has {prompt_len} tokens, max_model_len is {lim.max_model_len}", cuts.WINDOW)
        # 0: what is left is reserved by calls still generating; they may hand some back (`reserve` waits).
        free = budget_left - self._reserved
        return max(0, min(turn_cap, room, free)), cuts.binding_limit(turn_cap, room, free)

    async def reserve(self, prompt_len: int, first: bool, requested: int | None,
                      check_deadline: Callable[[], None], turn_cap: int | None = None) -> tuple[int, str]:
        """This call's new tokens, taken from the episode's budget before it generates, and the limit that set
        them (the request's own `max_tokens` when it asked for fewer: "max_tokens"). `turn_cap` replaces the
        per-turn cap for a call with a cap of its own (a summary's summary_max_tokens). The check and the
        reservation run without an await between them, and every call of an episode runs on its loop, so
        parallel calls never promise more than the budget together. `check_deadline` runs after each wait."""
        while True:
            max_tokens, limit = self._max_tokens(prompt_len, first, turn_cap)
            if max_tokens > 0:
                if requested is not None and int(requested) <= max_tokens:  # its own cap binds, even on a tie
                    max_tokens, limit = max(1, int(requested)), cuts.REQUEST
                self._reserved += max_tokens
                return max_tokens, limit
            self._budget_freed = self._budget_freed or asyncio.Event()
            await self._budget_freed.wait()
            check_deadline()

    def release(self, reserved: int) -> None:
        """A call ended: its reservation goes back to the budget."""
        self._reserved -= reserved
        if self._budget_freed is not None:
            self._budget_freed.set()  # waiting calls look again: what this call did not use is theirs
            self._budget_freed = None

    def give_back(self, tokens: int) -> None:
        """The tokens of a call the episode un-records (`ModelTuner.discard`) leave the budget."""
        self.generated_tokens -= tokens
        if self._budget_overflow and self.generated_tokens < self.limits.max_response_tokens:
            # A call refused while this one held the budget: the record no longer spends it, so neither the
            # episode (flagged overflowed) nor the retry that comes next is cut short.
            self.overflowed, self.overflow_reason, self.overflow_limit, self._budget_overflow = False, None, "", False
