"""The teacher stage of on-policy distillation: between rollout and advantage, the teacher scores every trainable
call of a step's episodes in the exact context the student saw (`LLMCall.teacher_logprobs`, and with
algorithm.distill_topk = k the teacher's k likeliest tokens at each of its positions, `LLMCall.teacher_topk`).

An episode the teacher could not score (a request that failed, timed out or answered short) is flagged failed
(FLAG_FAILED + FLAG_TEACHER_FAILED, error source "teacher"): left out of the advantage groups and the samples and
counted in the step's failure_rate, as a sandbox that cannot start is; never trained as a zero.

Metrics: distill/teacher_s (the stage's wall time), distill/teacher_sequences and distill/teacher_tokens (what was
sent), distill/teacher_failed_episodes.
"""

from __future__ import annotations

import logging
import time
import traceback

from astuner.algorithm.distillation import response_slice, teacher_chains
from astuner.types import FLAG_FAILED, FLAG_TEACHER_FAILED, Episode

log = logging.getLogger(__name__)


def score_episodes(teacher, episodes: list[Episode], topk: int = 0) -> dict[str, float]:
    """Fill `teacher_logprobs` (and with `topk`, `teacher_topk`) of every trainable call of the trainable episodes;
    flag those it cannot score."""
    jobs = [(ep, chain) for ep in episodes if ep.trainable for chain in teacher_chains(ep.calls)]
    sequences = [ep.calls[chain[-1]].prompt_ids + ep.calls[chain[-1]].response_ids for ep, chain in jobs]
    started = time.perf_counter()
    results = teacher.score(sequences, topk=topk) if sequences else []
    failed: set[str] = set()
    for (ep, chain), result in zip(jobs, results):
        try:
            if isinstance(result, BaseException):
                raise result
            scored = [(ep.calls[i], response_slice(result.values, ep.calls[i]),
                       response_slice(result.topk, ep.calls[i]) if topk else None) for i in chain]
        except Exception as exc:  # noqa: BLE001 - flagged and quoted, never trained
            if ep.episode_uid not in failed:
                failed.add(ep.episode_uid)
                _flag(ep, exc, teacher)
            continue
        for call, values, top in scored:
            call.teacher_logprobs, call.teacher_topk = values, top
    return {"distill/teacher_s": time.perf_counter() - started,
            "distill/teacher_sequences": float(len(sequences)),
            "distill/teacher_tokens": float(sum(len(s) for s in sequences)),
            "distill/teacher_failed_episodes": float(len(failed))}


def _flag(episode: Episode, exc: BaseException, teacher) -> None:
    from astuner.rollout_episode import describe_exception

    name = getattr(teacher, "name", type(teacher).__name__)
    summary = f"the teacher {name} could not score this episode: {describe_exception(exc)}"
    episode.flags += [f for f in (FLAG_FAILED, FLAG_TEACHER_FAILED) if f not in episode.flags]
    episode.error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) or summary
    episode.error_summary, episode.error_source = summary, "teacher"
    for call in episode.calls:
        call.teacher_logprobs = call.teacher_topk = None
    log.warning("episode %s: %s", episode.episode_uid, summary)
