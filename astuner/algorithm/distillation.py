"""On-policy distillation: the student samples its own episodes and a teacher scores every token it sampled.

For a response token x_t that the student pi_S sampled in context c_t (the exact ids it saw, tool results and
earlier turns included):

    s_t = log pi_S(x_t | c_t)    the engine's sampling logprob, recorded with the call (its temperature's)
    q_t = log pi_T(x_t | c_t)    the teacher's logprob of the same token in the same context (temperature 1)

    A_t = m_t * ( kl_coef * (q_t - s_t)  +  reward_weight * A_ep )

m_t is the loss mask (0 on tool results and turn markers that `sample_mode: merge` joins in), A_ep the episode's
group advantage from its reward (the run's adv_estimator). s_t - q_t is the one-sample estimate of the reverse KL
KL(pi_S || pi_T) = E_{x ~ pi_S}[log pi_S(x) - log pi_T(x)] at token t, so a policy gradient on A_t lowers it: tokens
the teacher finds likelier than the student did are pushed up, the others down, from the first step, whatever the
reward. This is the per-token reverse KL of tinker-cookbook's on-policy distillation (and TRL's GKD with
lambda = 1, beta = 1). The loss is the policy-gradient one (`objectives.PolicyGradient`: PPO-clip with the
engine's logprobs as old logprobs), which takes A_t per token where GRPO broadcasts A_ep.

Reported per step: distill/reverse_kl, the mean of s_t - q_t over trained tokens (falls as the student learns),
and distill/teacher_logprob, distill/student_logprob, their means; with the top-k term (below),
distill/teacher_topk_mass, the mean probability the teacher puts on its top k (how much of it the term sees).

The top-k term (algorithm.distill_topk = k > 0). The sampled token alone tells the student nothing about the
tokens it did not sample: a token the teacher would write and the student almost never samples (the first token of
a tool call, for a student that has never made one) rises only through the normalisation, slowly. With the
teacher's k likeliest tokens V_t at each position, renormalised over them (p~_tv = exp(q_tv) / sum_{u in V_t}
exp(q_tu)), the loss adds the forward KL to the teacher on that support, under the student's raw distribution
(temperature 1, no sampling filter: the model the teacher is compared with):

    KL~_t = sum_{v in V_t} p~_tv * (log p~_tv - log pi_S(v | c_t))      >= 0
    L    += topk_coef * sum_t w_t * KL~_t                                (w_t: the policy loss's token weights)

Its gradient lifts every token of V_t towards p~_t whether or not it was sampled (GKD's forward-KL direction, on
the teacher's top k rather than the whole vocabulary, which is what a server returns). Reported as
actor/distill_topk_kl, the mean of KL~_t over trained tokens.

The teacher's temperature (algorithm.distill_teacher_temperature = tau, with the top k). At a decision where the
teacher itself hesitates (here: 0.35 to 0.46 for starting another tool call once the code is known, against
answering), distillation pulls the student toward that hesitation, and greedy decoding follows whichever side the
last updates left ahead. With tau < 1 the teacher is sharpened before both terms, over its top k:

    log Z_t = log sum_{v in V_t} exp(q_tv / tau)       q_t <- q_t / tau - log Z_t       q_tv <- q_tv / tau - log Z_t

(0.4 against 0.6 becomes 0.31 against 0.69 at tau = 0.5). Z_t over V_t rather than the whole vocabulary: the tail
outside it adds at most (1 - mass_t)^(1/tau) for tau < 1, and the top 8 held 0.99 of the teacher by step 7 here.
distill/teacher_topk_mass is the teacher's own, before sharpening; distill/reverse_kl and distill/teacher_logprob
are the sharpened teacher's (the log viewer shows the teacher's own). tau > 1 is refused by the config: the tail
outside V_t would then hold more than Z_t counts.

Which tokens a teacher scores: each trainable call's response, in its own context. Calls of one agent whose prompt
extends the previous call's prompt + response exactly (`teacher_chains`) are scored as one sequence, the last
call's: the earlier responses sit at the same positions with the same prefix, so their logprobs are read from it.
Pure Python (no torch).
"""

from __future__ import annotations

import math

from astuner.algorithm.samples import extends
from astuner.types import LLMCall, Sample


def distill_advantages(student: list[float], teacher: list[float], mask: list[int] | None, kl_coef: float,
                       reward_advantage: float, reward_weight: float) -> list[float]:
    """A_t of every response token (module docstring); 0 where the mask is 0."""
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student logprobs but {len(teacher)} teacher logprobs")
    mask = mask if mask is not None else [1] * len(student)
    base = reward_weight * reward_advantage
    return [(kl_coef * (q - s) + base) if m else 0.0 for s, q, m in zip(student, teacher, mask)]


def log_normaliser(logits: list[float]) -> float:
    """log sum_i exp(x_i), shifted by the largest so no term overflows (-inf for none)."""
    if not logits:
        return -math.inf
    top = max(logits)
    return top + math.log(sum(math.exp(x - top) for x in logits))


def sharpen(teacher: list[float], topk: list[list[tuple[int, float]]], tau: float
            ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The teacher's logprobs of the sampled tokens and its top-k rows at temperature `tau`, renormalised over each
    position's top k (module docstring); a position without a top-k row (masked) keeps its logprob."""
    if len(topk) != len(teacher):
        raise ValueError(f"{len(teacher)} teacher logprobs but top-k rows at {len(topk)} positions")
    out_q, out_rows = [], []
    for q, row in zip(teacher, topk):
        if not row:
            out_q.append(q)
            out_rows.append(row)
            continue
        scaled = [lp / tau for _, lp in row]
        log_z = log_normaliser(scaled)
        out_q.append(q / tau - log_z)
        out_rows.append([(t, x - log_z) for (t, _), x in zip(row, scaled)])
    return out_q, out_rows


def distill_samples(samples: list[Sample], kl_coef: float, reward_weight: float,
                    teacher_temperature: float = 1.0) -> dict[str, float]:
    """Set every sample's `token_advantages` (its `advantage` is the reward's group advantage on entry; it becomes
    reward_weight times that, the part every token shares); the step's distill/ figures. With a teacher
    temperature other than 1 the sample's teacher logprobs and top k are replaced by the sharpened ones first (the
    top-k term then reads those). A sample without teacher logprobs is a bug of the stage before (its episode
    should have been flagged), hence ValueError."""
    kl = student_sum = teacher_sum = tokens = mass = 0.0
    for s in samples:
        if s.teacher_logprobs is None:
            raise ValueError(f"episode {s.episode_uid}: a sample without teacher logprobs reached distillation")
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        mass += sum(math.exp(q) for row, m in zip(s.teacher_topk or [], mask) if m for _, q in row)
        if teacher_temperature != 1.0:
            if s.teacher_topk is None:
                raise ValueError(f"episode {s.episode_uid}: a teacher temperature needs the teacher's top k")
            s.teacher_logprobs, s.teacher_topk = sharpen(s.teacher_logprobs, s.teacher_topk, teacher_temperature)
        s.token_advantages = distill_advantages(s.old_logprobs, s.teacher_logprobs, mask, kl_coef, s.advantage,
                                                reward_weight)
        s.advantage = reward_weight * s.advantage
        for lp, tq, m in zip(s.old_logprobs, s.teacher_logprobs, mask):
            if m:
                kl += lp - tq
                student_sum += lp
                teacher_sum += tq
                tokens += 1
    if not tokens:
        return {}
    out = {"distill/reverse_kl": kl / tokens, "distill/student_logprob": student_sum / tokens,
           "distill/teacher_logprob": teacher_sum / tokens}
    if any(s.teacher_topk is not None for s in samples):  # how much of the teacher the top-k term sees
        out["distill/teacher_topk_mass"] = mass / tokens
    return out


def topk_rows(samples: list[Sample], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """For every response token of `samples` (flat, in order): the teacher's top-k token ids padded to k (with id
    0) and their probabilities renormalised over the top-k (p~, module docstring), 0 at the padding and at tokens
    without a top-k (masked ones, where the merge joined a tool result in)."""
    ids: list[list[int]] = []
    probs: list[list[float]] = []
    for s in samples:
        rows = s.teacher_topk if s.teacher_topk is not None else [[] for _ in s.response_ids]
        if len(rows) != len(s.response_ids):
            raise ValueError(f"episode {s.episode_uid}: {len(s.response_ids)} response tokens but the teacher's "
                             f"top-k at {len(rows)} positions")
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        for row, m in zip(rows, mask):
            row = row[:k] if m else []
            log_z = log_normaliser([lp for _, lp in row])
            ids.append([t for t, _ in row] + [0] * (k - len(row)))
            probs.append([math.exp(lp - log_z) for _, lp in row] + [0.0] * (k - len(row)))
    return ids, probs


def token_advantages(sample: Sample) -> list[float]:
    """The advantage of each response token: its own (on-policy distillation), else the sample's, broadcast."""
    if sample.token_advantages is not None:
        return sample.token_advantages
    return [sample.advantage] * len(sample.response_ids)


def carries_advantage(sample: Sample) -> bool:
    """Whether some token of the sample has a nonzero advantage (else its policy-gradient term is exactly 0)."""
    if sample.token_advantages is not None:
        return any(a != 0.0 for a in sample.token_advantages)
    return sample.advantage != 0.0


def teacher_chains(calls: list[LLMCall]) -> list[list[int]]:
    """The trainable calls (a response, `trainable`) as chains of indices: a call joins the chain of its agent's
    previous call when its prompt extends that call's prompt + response exactly; the last call of a chain holds
    every token of the chain in place."""
    chains: list[list[int]] = []
    open_chain: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        if not (c.response_ids and c.trainable):
            continue
        chain = open_chain.get(c.agent)
        if chain is not None and extends(calls[chain[-1]].prompt_ids + calls[chain[-1]].response_ids, c.prompt_ids):
            chain.append(i)
            continue
        chain = [i]
        chains.append(chain)
        open_chain[c.agent] = chain
    return chains


def response_slice(values: list, call: LLMCall) -> list:
    """What a scored sequence that begins with `call`'s prompt + response holds for the call's response tokens
    (their logprobs, or their positions' top-k): `values[i]` is about x_{i+1} given x_<=i, so the token at position
    p has values[p - 1]."""
    start = len(call.prompt_ids) - 1
    out = values[start : start + len(call.response_ids)]
    if len(out) != len(call.response_ids) or start < 0:
        raise ValueError(f"the teacher scored {len(values) + 1} tokens; the call needs "
                         f"{len(call.prompt_ids) + len(call.response_ids)}")
    return list(out)
