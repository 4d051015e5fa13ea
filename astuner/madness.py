"""Madness checks: cheap per-call detectors of degenerate model output.

Each check in `MADNESS_CHECKS` takes a `CallView` and returns a reason (str) when it fires, else None. The
ModelTuner runs the checks named in `rollout.compute_madness_checklist` on every call and adds the check's name
to `LLMCall.flags`; the rollout gives such episodes `agent_madness_reward`.

The thresholds favour few false positives: punishing a correct answer for looking odd is worse than missing a
mild loop, which the task reward usually punishes anyway.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Callable

from astuner.types import FLAG_NONSENSE, FLAG_WRONG_TOOLCALL

# Looping: a span of >= LOOP_MIN_SPAN tokens repeated >= LOOP_MIN_REPEATS times back to back at the end, or a
# shorter span repeating over >= LOOP_MIN_RUN tokens (short-period loops like "the the the ...", which need a
# longer run since short repeats such as "0, 0, 0" or "----" are normal).
LOOP_MIN_SPAN = 8
LOOP_MIN_REPEATS = 4
LOOP_MIN_RUN = 128
LOOP_MAX_SPAN = 512
# Low diversity: very few distinct tokens among the last DIVERSITY_WINDOW (at least DIVERSITY_MIN_TOKENS) tokens,
# for babble that is not strictly periodic. Measured over a window because the distinct-token ratio of normal
# text falls with its length. Kept very strict: on tokenizers that split numbers into digits, real numeric tables
# and long numbers reach ~0.01-0.04 (10-40 distinct ids in 1024), and those must pass.
DIVERSITY_MIN_TOKENS = 256
DIVERSITY_WINDOW = 1024
DIVERSITY_MIN_RATIO = 0.008
# Garbled: share of replacement / control characters, or one long run of them.
GARBLED_MIN_CHARS = 4
GARBLED_MIN_SHARE = 0.1
GARBLED_MAX_RUN = 16


@dataclass
class CallView:
    """What the checks see of one call."""

    response_ids: list[int]
    text: str
    special_ids: set[int] = field(default_factory=set)
    stop_ids: set[int] = field(default_factory=set)
    tool_errors: list[str] = field(default_factory=list)


def _is_bad_char(ch: str) -> bool:
    if ch == "\ufffd":
        return True
    return ch not in "\n\r\t" and unicodedata.category(ch) == "Cc"


def _garbled_reason(text: str) -> str | None:
    bad = run = longest = 0
    for ch in text:
        if _is_bad_char(ch):
            bad += 1
            run += 1
            longest = max(longest, run)
        else:
            run = 0
    if longest >= GARBLED_MAX_RUN:
        return f"garbled text: a run of {longest} replacement/control characters"
    if bad >= GARBLED_MIN_CHARS and bad / max(len(text), 1) >= GARBLED_MIN_SHARE:
        return f"garbled text: {bad} of {len(text)} characters are replacement/control characters"
    return None


def _tail_loop_reason(ids: list[int]) -> str | None:
    """Find a period p such that the end of `ids` is p-periodic over a long stretch.

    A partial last repetition (generation cut by max_tokens) still counts, since periodicity is checked token
    by token (ids[j] == ids[j - p]) walking back from the end.
    """
    n = len(ids)
    for p in range(1, min(LOOP_MAX_SPAN, n // 2) + 1):
        j = n - 1
        while j >= p and ids[j] == ids[j - p]:
            j -= 1
        run = (n - 1 - j) + p  # tokens covered by the periodic tail, first copy included
        repeats = run / p
        long_span_loop = p >= LOOP_MIN_SPAN and repeats >= LOOP_MIN_REPEATS
        short_span_loop = p < LOOP_MIN_SPAN and run >= LOOP_MIN_RUN
        if long_span_loop or short_span_loop:
            return f"looping: the last {run} tokens repeat a {p}-token span {repeats:.1f} times"
    return None


def detect_nonsense(response_ids: list[int], text: str, special_ids: set[int], stop_ids: set[int]) -> str | None:
    """A reason when the response leaks special tokens, is garbled or loops; None for normal output."""
    ids = list(response_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]  # the stop token that ended generation is expected
    for position, token in enumerate(ids):
        if token in special_ids:
            return f"special token id {token} leaked at position {position}"
    reason = _garbled_reason(text)
    if reason:
        return reason
    reason = _tail_loop_reason(ids)
    if reason:
        return reason
    window = ids[-DIVERSITY_WINDOW:]
    if len(window) >= DIVERSITY_MIN_TOKENS:
        distinct = len(set(window))
        if distinct / len(window) < DIVERSITY_MIN_RATIO:
            return f"looping: only {distinct} distinct tokens among the last {len(window)}"
    return None


def check_nonsense(view: CallView) -> str | None:
    return detect_nonsense(view.response_ids, view.text, view.special_ids, view.stop_ids)


def check_wrong_toolcall(view: CallView) -> str | None:
    return "; ".join(view.tool_errors) if view.tool_errors else None


MADNESS_CHECKS: dict[str, Callable[[CallView], str | None]] = {
    FLAG_NONSENSE: check_nonsense,
    FLAG_WRONG_TOOLCALL: check_wrong_toolcall,
}


def validate_checklist(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = [n for n in names if n not in MADNESS_CHECKS]
    if unknown:
        raise ValueError(f"unknown madness check(s) {unknown}; available: {', '.join(MADNESS_CHECKS)}")
    return tuple(names)


def run_checks(names: tuple[str, ...] | list[str], view: CallView) -> dict[str, str]:
    """{check name: reason} for every named check that fires."""
    found = {}
    for name in names:
        reason = MADNESS_CHECKS[name](view)
        if reason:
            found[name] = reason
    return found
