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
and distill/teacher_logprob, distill/student_logprob, their means.

Which tokens a teacher scores: each trainable call's response, in its own context. Calls of one agent whose prompt
extends the previous call's prompt + response exactly (`teacher_chains`) are scored as one sequence, the last
call's: the earlier responses sit at the same positions with the same prefix, so their logprobs are read from it.
Pure Python (no torch).
"""

from __future__ import annotations

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


def distill_samples(samples: list[Sample], kl_coef: float, reward_weight: float) -> dict[str, float]:
    """Set every sample's `token_advantages` (its `advantage` is the reward's group advantage on entry; it becomes
    reward_weight times that, the part every token shares); the step's distill/ figures. A sample without teacher
    logprobs is a bug of the stage before (its episode should have been flagged), hence ValueError."""
    kl = student_sum = teacher_sum = tokens = 0.0
    for s in samples:
        if s.teacher_logprobs is None:
            raise ValueError(f"episode {s.episode_uid}: a sample without teacher logprobs reached distillation")
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
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
    return {"distill/reverse_kl": kl / tokens, "distill/student_logprob": student_sum / tokens,
            "distill/teacher_logprob": teacher_sum / tokens}


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


def response_logprobs(values: list[float], call: LLMCall) -> list[float]:
    """The logprobs of `call`'s response tokens from a scored sequence that begins with its prompt + response:
    `values[i]` = log p(x_{i+1} | x_<=i), so the token at position p has values[p - 1]."""
    start = len(call.prompt_ids) - 1
    out = values[start : start + len(call.response_ids)]
    if len(out) != len(call.response_ids) or start < 0:
        raise ValueError(f"the teacher scored {len(values) + 1} tokens; the call needs "
                         f"{len(call.prompt_ids) + len(call.response_ids)}")
    return list(out)
