"""The truncation ledger: which limit cut an episode, where, and what training does with it.

Three limits are kept apart, each with its own label:
  turn_cap   a call's response reached rollout.max_response_length_in_one_turn (the per-turn cap);
  budget     the episode's generated tokens reached data.max_response_length (a call cut short by what was left,
             or a later call refused because nothing was);
  window     prompt + response reached rollout.max_model_len (a call cut short by the room its prompt left, or a
             later call refused because its prompt left none).
Three more: `prompt` (an episode whose first prompt is over data.max_prompt_length), `summary_cap` (a summary the
context policy asked for, cut at rollout.summary_max_tokens), and `max_tokens`: a call the agent itself capped (its
request's max_tokens, when no larger than what the run allowed), the agent's choice.

A call cut short carries its label (`LLMCall.cut`); an episode a refused call ended carries the refusing limit
(`Episode.cut`, and the flag "overflow", as before). When a call's new-token allowance
    min(turn cap, window - prompt, budget - generated - reserved)
is met by several limits at once, the label is the first of window, budget, turn_cap among them: the scarcer
resource names the cut (raising the turn cap would not have helped).

`rollout.on_cut` decides what training does with a cut episode (`apply_policy`, in the rollout):
  train  cut calls train as sampled (as verl and TRL do by default); an episode a limit ended trains with
         reward 0 (astuner's rule for an episode that could not finish);
  mask   the cut calls' tokens leave the loss (TRL's mask_truncated_completions, DAPO's overlong filtering): the
         call stays recorded, shown and merged around, but is not trained; an episode a limit ended is not
         trained on (flag "cut_dropped": its reward 0 is the limit's, not the model's);
  drop   an episode with any cut (the agent's own max_tokens aside) is not trained on (flag "cut_dropped").
A failed or timed-out episode is not trained whatever its cuts, and is not flagged again.
Each step logs `rollout/cut/<limit>`: the episodes with a cut of that limit (counted once per episode), and
`rollout/cut/dropped`. What rollout.context_policy did instead of a cut (model_tuner/context.py) is logged beside:
`rollout/context/compactions` and `rollout/context/resets` (per episode) and `rollout/context/summary_length` (mean
tokens of a summary call, when there was one); with sub-agents, `rollout/context/subagent_calls` (per episode) and
`rollout/context/subagent_report_length` (mean tokens of a report).
"""

from __future__ import annotations

from astuner.types import FLAG_CUT_DROPPED, FLAG_FAILED, FLAG_TIMEOUT, Episode

TURN_CAP = "turn_cap"
BUDGET = "budget"
WINDOW = "window"
PROMPT = "prompt"
SUMMARY_CAP = "summary_cap"
REQUEST = "max_tokens"
# The limits the run sets (rollout.on_cut acts on these; the agent's own max_tokens is its design).
RUN_LIMITS = (TURN_CAP, BUDGET, WINDOW, PROMPT, SUMMARY_CAP)
LABELS = (*RUN_LIMITS, REQUEST)
# rollout.on_cut, in one line each (the start-up block says the chosen one).
POLICIES = {"train": "cut calls train as sampled, an episode a limit ended trains with reward 0",
            "mask": "cut calls leave the loss, an episode a limit ended is not trained",
            "drop": "an episode with any cut is not trained"}


def binding_limit(turn_cap: int, room: int, budget_left: int) -> str:
    """The limit that sets a call's allowance min(turn_cap, room, budget_left); ties go to window, then budget."""
    smallest = min(turn_cap, room, budget_left)
    if room == smallest:
        return WINDOW
    if budget_left == smallest:
        return BUDGET
    return TURN_CAP


def call_cut(finish_reason: str, n_tokens: int, max_tokens: int, limit: str) -> str:
    """The label of a call whose response is `n_tokens` long under an allowance of `max_tokens` set by `limit`:
    the limit when the engine stopped for length at the allowance, "" when the response ended on its own."""
    return limit if finish_reason == "length" and n_tokens >= max_tokens else ""


def episode_cuts(episode: Episode) -> list[str]:
    """Every cut of the episode, in order: each cut call's label, then the limit that ended it, if any."""
    return [c.cut for c in episode.calls if c.cut] + ([episode.cut] if episode.cut else [])


def apply_policy(episode: Episode, policy: str) -> None:
    """Apply rollout.on_cut to one ended episode (rules in the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"rollout.on_cut must be one of {tuple(POLICIES)}, got {policy!r}")
    if policy == "train" or FLAG_FAILED in episode.flags or FLAG_TIMEOUT in episode.flags:
        return
    run_cuts = [c for c in episode.calls if c.cut in RUN_LIMITS]
    if episode.cut or (policy == "drop" and run_cuts):
        if FLAG_CUT_DROPPED not in episode.flags:
            episode.flags.append(FLAG_CUT_DROPPED)
    if policy == "mask":
        for call in run_cuts:
            call.trainable = False


def cut_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Per limit, the episodes with a cut of it (each counted once), and the episodes not trained for a cut."""
    out = {f"{prefix}/cut/{label}": float(sum(label in episode_cuts(e) for e in episodes)) for label in LABELS}
    out[f"{prefix}/cut/dropped"] = float(sum(FLAG_CUT_DROPPED in e.flags for e in episodes))
    return out


def context_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Compactions and contexts agents started anew, per episode; the mean length of summary calls and sub-agent
    reports, and sub-agent calls per episode (when there were any)."""
    n = max(len(episodes), 1)
    calls = [c for e in episodes for c in e.calls]
    out = {f"{prefix}/context/compactions": sum(c.context == "compacted" for c in calls) / n,
           f"{prefix}/context/resets": sum(c.context == "reset" for c in calls) / n}
    for label, name in (("summary", "summary_length"), ("subagent", "subagent_report_length")):
        lengths = [len(c.response_ids) for c in calls if c.context == label]
        if lengths:
            out[f"{prefix}/context/{name}"] = sum(lengths) / len(lengths)
    if any(c.context == "subagent" for c in calls):
        out[f"{prefix}/context/subagent_calls"] = sum(c.context == "subagent" for c in calls) / n
    return out
