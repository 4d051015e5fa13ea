"""Episodes (+ the samples trained on them) -> the records the log viewer stores, token by token.

For each call: its response token ids, each token decoded alone, the engine's sampling logprob, the teacher's
(on-policy distillation), the trainer's logprob before the update (where the call was forwarded in the step's
first mini-batch), the loss mask (1 where the token was trained on: the call became, or joined, a sample with a
non-zero weight) and the advantage. A merged sample (sample_mode merge) is split back into its calls along its
loss mask.

Each call also carries its context (rollout.context_policy, model_tuner/context.py): its agent's `segment` and its
`context` label; reading an episode back, `link_contexts` links a summary's or a sub-agent's call to the call first
shown its work (`shown_in`) and that call to them (`made_by`), so the viewer shows a compaction as one chain.
"""

from __future__ import annotations

from typing import Any

from astuner.types import Episode, Sample


def _per_call_training(samples: list[Sample]) -> dict[tuple[str, int], tuple[float, list[float] | None]]:
    """(episode uid, call index) -> (advantage, trainer logprobs of that call's response or None)."""
    out: dict[tuple[str, int], tuple[float, list[float] | None]] = {}
    for s in samples:
        if not s.call_indices:
            continue
        mask = s.loss_mask or [1] * len(s.response_ids)
        lps = s.trainer_logprobs
        # Runs of 1s in the mask are the calls' responses, in order.
        runs: list[tuple[int, int]] = []
        start = None
        for i, m in enumerate(mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append((start, i))
                start = None
        for call_index, (a, b) in zip(s.call_indices, runs):
            out[(s.episode_uid, call_index)] = (s.advantage, None if lps is None else lps[a:b])
    return out


SIDE_CALLS = ("summary", "subagent")  # calls a context policy made; the next "compacted" call of the agent shows them


def link_contexts(calls: list[dict[str, Any]]) -> None:
    """In place, on an episode's call records in order: a summary's or sub-agent's call gets `shown_in` (the index
    of its agent's next call marked compacted, the first shown its work; None when none came), and each call
    `made_by` (the indices of the side calls whose work it was first shown; empty for most)."""
    pending: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        call["made_by"], call["shown_in"] = [], None
        if call.get("context") in SIDE_CALLS:
            pending.setdefault(call.get("agent") or "", []).append(i)
        elif call.get("context") == "compacted":
            call["made_by"] = pending.pop(call.get("agent") or "", [])
            for j in call["made_by"]:
                calls[j]["shown_in"] = i


def episode_records(episodes: list[Episode], samples: list[Sample] | None, tokenizer) -> list[dict[str, Any]]:
    trained = _per_call_training(samples or [])
    advantage_of = {s.episode_uid: s.advantage for s in samples or []}

    def pieces(ids: list[int]) -> list[str]:
        if tokenizer is None:
            return [str(i) for i in ids]
        return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)

    records = []
    for ep in episodes:
        calls = []
        for index, call in enumerate(ep.calls):
            adv, trainer_lps = trained.get((ep.episode_uid, index), (None, None))
            n = len(call.response_ids)
            calls.append({
                "agent": call.agent,
                "model": call.model,
                "trainable": call.trainable,
                "messages": call.messages or [],
                "reply": call.reply,
                "response_text": call.response_text,
                "finish_reason": call.finish_reason,
                # shown as the call's badges: its flags, the limit that cut it, its context segment
                "flags": call.flags + ([f"cut: {call.cut}"] if call.cut else [])
                + ([f"segment {call.segment}"] if call.segment else []) + ([call.context] if call.context else []),
                "segment": call.segment,
                "context": call.context,
                "prompt_tokens": len(call.prompt_ids),
                "tokens": {
                    "ids": list(call.response_ids),
                    "text": pieces(call.response_ids),
                    "logprob": [round(x, 5) for x in call.response_logprobs],
                    "trainer_logprob": None if trainer_lps is None else [round(x, 5) for x in trainer_lps],
                    # On-policy distillation: the teacher's logprob of each token, in the same context.
                    "teacher_logprob": (None if call.teacher_logprobs is None
                                        else [round(x, 5) for x in call.teacher_logprobs]),
                    "mask": [1 if adv is not None else 0] * n,
                    "advantage": adv,
                },
            })
        for call in calls:  # messages are stored on the call; keep the reply beside them for the chat view
            if call["reply"] is not None:
                call["messages"] = call["messages"] + [dict(call["reply"], _reply=True)]
            del call["reply"]
        records.append({
            "uid": ep.episode_uid,
            "task_id": ep.task.task_id,
            "query": ep.task.main_query,
            "reward": ep.reward,
            "success": ep.is_success,
            "flags": list(ep.flags) + ([f"cut: {ep.cut}"] if ep.cut else []),
            "error": ep.error,
            "seconds": round(ep.seconds, 3),
            "advantage": advantage_of.get(ep.episode_uid),
            "output": ep.output_metadata,
            "calls": calls,
        })
    return records
