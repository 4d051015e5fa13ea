"""What a step trains on, with which objective, and what it reports: one policy object, chosen at start.

    Plain                     the step's batch; GRPO-family advantages (algorithm/samples.py), objective "policy"
    DynamicSampling           DAPO (filter_groups): more batches until `train_batch_size` groups carry a signal
    RejectionSampling         RFT: episodes with reward >= rft_reward_threshold, SFT on their exact ids
    DynamicRejectionSampling  both
    OfflineSFT, OfflinePreference   sft | dpo | orpo: the batch is read from offline data, no rollouts

`choose_selection(settings)` picks one from the config. The loop calls `gather` (roll out and keep), `learn`
(-> samples; stops a run whose episodes all failed), `report` (the step's metrics, assembled by the monitor),
`check_idle` and `standing_warnings` (for the summary), and never branches on the algorithm itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from astuner.algorithm.catalog import algorithm
from astuner.algorithm.distillation import carries_advantage
from astuner.algorithm.dynamic_sampling import informative_groups, keep_groups
from astuner.algorithm.samples import episodes_to_samples
from astuner.errors import TrainingStalled
from astuner.monitor.metrics import StepMetrics, zero_adv_group_fraction
from astuner.types import FLAG_CUT_DROPPED, Episode, Sample, Task

log = logging.getLogger(__name__)


FIX_ADVICE = {
    "workflow": "Fix the workflow (run with --backbone debug and a breakpoint in it), or raise "
                "astuner.rollout.episode_timeout if the episodes are just slow.",
    "remote": "Check that remote clients run against this server (astuner.remote.RemoteClient(url).run(agent), e.g. "
              "tutorial/remote_agent/agent_client.py) and read their output for the agent's error, or raise "
              "astuner.rollout.episode_timeout if the episodes are just slow.",
    "teacher": "Check the teacher (astuner.teacher): its server is up and answers /v1/completions with echo and "
               "logprobs, or its model folder loads; raise astuner.teacher.timeout_s if it is just slow.",
    "environment": "Check the environment (its package, its server or its data: the error quotes its own "
                   "message); raise astuner.rollout.env_timeout if its calls are just slow, or "
                   "astuner.rollout.env_retries if it fails now and then.",
    "judge": "Fix the judge (astuner.task_judge.judge_protocol; run with --backbone debug and a breakpoint in "
             "compute_reward), or raise astuner.task_judge.timeout if it is just slow.",
}


def first_error(episodes: list[Episode]) -> tuple[str, str] | None:
    """(where, what) of the first failed episode: the part that failed ("workflow" or "judge") and a line
    quoting its error."""
    for e in episodes:
        if e.error:
            lines = e.error.strip().splitlines()
            what = e.error_summary or (lines[-1] if lines else e.error)
            return e.error_source or "workflow", f"episode {e.episode_uid}: {what}"
    return None



@dataclass
class SelectionSettings:
    """What the selection policies read: the algorithm type, advantages, dynamic sampling, RFT's threshold, the
    idle stop. Copied from the effective config (config/effective.py), so no field needs a condition here."""

    train_batch_size: int
    adv_estimator: str
    norm_adv_by_std: bool
    adv_epsilon: float
    max_sample_per_task: int
    max_idle_steps: int = 5
    grad_without_advantage: bool = False  # the KL or entropy term gives zero-advantage samples a gradient too
    sample_mode: str = "per_call"
    filter_groups: bool = False
    filter_metric: str = "score"
    max_num_gen_batches: int = 0
    algorithm: str = "grpo"  # an algorithm.type (astuner/algorithm/catalog.py)
    rft_threshold: float = 1.0
    distill_kl_coef: float = 1.0
    distill_reward_weight: float = 0.0
    distill_topk: int = 0
    distill_teacher_temperature: float = 1.0

    @classmethod
    def from_config(cls, typed) -> SelectionSettings:
        from astuner.config.effective import effective

        kind = algorithm(typed.astuner.trainer_common.algorithm.type)
        typed = effective(typed, kind)  # keys that do nothing here read their neutral values
        a, tc = typed.astuner, typed.astuner.trainer_common
        fg = tc.algorithm.filter_groups
        return cls(
            train_batch_size=a.data.train_batch_size,
            adv_estimator=tc.algorithm.adv_estimator,
            norm_adv_by_std=tc.algorithm.norm_adv_by_std_in_grpo,
            adv_epsilon=tc.algorithm.epsilon,
            max_sample_per_task=a.rollout.multi_turn.max_sample_per_task,
            max_idle_steps=tc.max_idle_steps,
            grad_without_advantage=tc.use_kl_loss or tc.entropy_coeff > 0,
            sample_mode=a.rollout.multi_turn.sample_mode,
            filter_groups=fg.enable,
            filter_metric=fg.metric,
            max_num_gen_batches=fg.max_num_gen_batches,
            algorithm=tc.algorithm.type,
            rft_threshold=tc.algorithm.rft_reward_threshold,
            distill_kl_coef=tc.algorithm.distill_kl_coef,
            distill_reward_weight=tc.algorithm.distill_reward_weight,
            distill_topk=tc.algorithm.distill_topk,
            distill_teacher_temperature=tc.algorithm.distill_teacher_temperature,
        )

@dataclass
class Chosen:
    """A step's rollouts: every episode rolled out, those kept for training (offline objectives: the batch's
    examples), the data cursor after the last batch used, and the selection's figures for the log."""

    episodes: list
    kept: list
    epoch: int
    position: int
    metrics: dict[str, float] = field(default_factory=dict)


class Plain:
    """Every episode of the step's batch trains the policy with its group-relative advantage."""

    objective: str  # the catalog's, set by choose_selection

    def __init__(self, settings) -> None:
        self.settings = settings
        self.metrics = StepMetrics()

    def gather(self, stages, tasks: list[Task], batches, step: int, epoch: int, position: int,
               progress=None) -> Chosen:
        episodes = stages.rollout(tasks, validation=False, step=step, progress=progress)
        return Chosen(episodes, episodes, epoch, position)

    def learn(self, chosen: Chosen, state, step: int) -> tuple[list[Sample], dict[str, float]]:
        """(samples to train, figures for the log); stops the run when every episode failed or timed out,
        quoting the first error of the run (kept in `state`)."""
        self._stop_if_all_failed(chosen.episodes, state, step)
        return self._samples(chosen.kept), {}

    def report(self, step: int, chosen: Chosen, samples: list[Sample], train_metrics: dict[str, float],
               seconds: dict[str, float], extra: dict[str, float]) -> dict[str, float]:
        return self.metrics.of_step(step, chosen.episodes, samples, train_metrics, seconds, extra)

    def standing_warnings(self) -> list[str]:
        """Warnings that still hold after the last step, repeated in the run's summary."""
        return self.metrics.standing_warnings()

    def check_idle(self, state, chosen: Chosen, samples: list[Sample], step: int) -> None:
        """Never silently idle: `max_idle_steps` steps in a row without a sample that carries a gradient stop
        the run."""
        s = self.settings
        if any(carries_advantage(x) for x in samples) or (s.grad_without_advantage and bool(samples)):
            state.idle_steps = 0
            return
        state.idle_steps += 1
        why = self.idle_reason(zero_adv_group_fraction(chosen.episodes))
        log.warning("step %d trained on nothing: %s (%d of %d idle steps allowed in a row)", step, why,
                    state.idle_steps, s.max_idle_steps)
        if state.idle_steps >= s.max_idle_steps:
            raise TrainingStalled(
                f"stopped after {state.idle_steps} steps in a row without a learning signal (step {step}): {why}. "
                f"First error: {state.first_error or 'none'}. Check the judge's rewards in the trajectories folder; "
                "the task may be too hard (all 0) or too easy (all 1) for this model (from a warm start that scores "
                "all 0, draw another: `astuner warmstart --seed 1`), or raise astuner.trainer_common.max_idle_steps."
                + "".join(f" Also: {w}" for w in self.standing_warnings())
            )

    @staticmethod
    def _stop_if_all_failed(episodes: list[Episode], state, step: int) -> None:
        if state.first_error is None and (found := first_error(episodes)):
            state.first_error_source, state.first_error = found
        if not any(e.trainable for e in episodes):
            cut = sum(FLAG_CUT_DROPPED in e.flags for e in episodes)
            if cut:  # not a failure: rollout.on_cut left them out; the idle-step rule decides when to stop
                log.warning("step %d: %d of %d episodes were cut (rollout/cut/*) and rollout.on_cut left them out; "
                            "the others failed or timed out: nothing to train on this step", step, cut, len(episodes))
                return
            raise TrainingStalled(
                f"step {step}: all {len(episodes)} episodes failed or timed out, so there is nothing to train on. "
                f"First error: {state.first_error or 'none recorded'}. "
                f"{FIX_ADVICE.get(state.first_error_source, FIX_ADVICE['workflow'])}")

    def _samples(self, episodes: list[Episode], constant_advantage: float | None = None) -> list[Sample]:
        s = self.settings
        return episodes_to_samples(episodes, adv_estimator=s.adv_estimator, norm_by_std=s.norm_adv_by_std,
                                   epsilon=s.adv_epsilon, max_sample_per_task=s.max_sample_per_task,
                                   sample_mode=s.sample_mode, constant_advantage=constant_advantage)

    def idle_reason(self, zero_adv_group_fraction: float) -> str:
        """Why a step produced no learning signal, for the warning and the stop message."""
        if zero_adv_group_fraction == 1.0:
            return ("every task's episodes got the same reward (train/zero_adv_group_fraction = 1.0), so every GRPO "
                    "advantage is 0")
        return "no episode produced a trainable sample"


class DynamicSampling(Plain):
    """DAPO dynamic sampling (algorithm/dynamic_sampling.py): roll out further batches until `train_batch_size`
    groups carry a signal, or `max_num_gen_batches` batches were rolled out, or the data ends. Tasks already in
    this step (a batch that crosses an epoch) are skipped; the loop's data cursor moves past every batch used."""

    def gather(self, stages, tasks: list[Task], batches, step: int, epoch: int, position: int,
               progress=None) -> Chosen:
        s = self.settings
        episodes = stages.rollout(tasks, validation=False, step=step, progress=progress)
        want = s.train_batch_size
        kept = informative_groups(episodes, s.filter_metric)
        generated, seen = 1, {t.task_id for t in tasks}
        while len(kept) < want and (s.max_num_gen_batches == 0 or generated < s.max_num_gen_batches):
            try:
                more, epoch, position = next(batches)
            except StopIteration:
                break
            more = [t for t in more if t.task_id not in seen]
            seen.update(t.task_id for t in more)
            if not more:
                continue
            extra = stages.rollout(more, validation=False, step=step, progress=progress)
            generated += 1
            episodes = episodes + extra
            kept += informative_groups(extra, s.filter_metric)
        if len(kept) < want:
            log.warning("step %d: dynamic sampling found %d of %d groups with differing rewards in %d rollout "
                        "batches (cap filter_groups.max_num_gen_batches = %d, or the data ran out); training on "
                        "those", step, len(kept), want, generated, s.max_num_gen_batches)
        kept = kept[:want]
        groups = len({e.group_id for e in episodes})
        counts = {"gen_batches": generated, "kept_groups": len(kept), "dropped_groups": groups - len(kept)}
        return Chosen(episodes, keep_groups(episodes, kept), epoch, position,
                      {f"train/dynamic_sampling/{k}": float(v) for k, v in counts.items()})


class RejectionSampling(Plain):
    """RFT: of every episode rolled out, those with reward >= rft_reward_threshold, learnt by SFT on their exact
    ids (advantage 1 on every call)."""

    def learn(self, chosen: Chosen, state, step: int) -> tuple[list[Sample], dict[str, float]]:
        self._stop_if_all_failed(chosen.episodes, state, step)
        passed = [e for e in chosen.episodes if e.trainable and e.reward >= self.settings.rft_threshold]
        return (self._samples(passed, constant_advantage=1.0),
                {"train/rft_kept_episode_fraction": len(passed) / max(len(chosen.episodes), 1)})

    def idle_reason(self, zero_adv_group_fraction: float) -> str:
        return f"no episode reached algorithm.rft_reward_threshold = {self.settings.rft_threshold:g}"


class DynamicRejectionSampling(RejectionSampling, DynamicSampling):
    """RFT over the episodes dynamic sampling rolled out."""


class Distillation(Plain):
    """On-policy distillation (algorithm/distillation.py): the step's episodes, scored by the teacher
    (`stages.teacher`, distill/scoring.py) before their samples are made; every token's advantage is the teacher's
    logprob minus the student's, plus the reward's group advantage times distill_reward_weight."""

    def gather(self, stages, tasks: list[Task], batches, step: int, epoch: int, position: int,
               progress=None) -> Chosen:
        from astuner.distill.scoring import score_episodes

        chosen = super().gather(stages, tasks, batches, step, epoch, position, progress)
        if stages.teacher is None:  # the driver builds it for this algorithm type (loop.drive): a bug if not
            raise RuntimeError("on-policy distillation without a teacher: the stages were handed none")
        chosen.metrics.update(score_episodes(stages.teacher, chosen.kept, self.settings.distill_topk))
        return chosen

    def learn(self, chosen: Chosen, state, step: int) -> tuple[list[Sample], dict[str, float]]:
        from astuner.algorithm.distillation import distill_samples

        self._stop_if_all_failed(chosen.episodes, state, step)
        samples = self._samples(chosen.kept)
        s = self.settings
        return samples, distill_samples(samples, s.distill_kl_coef, s.distill_reward_weight,
                                        s.distill_teacher_temperature)

    def idle_reason(self, zero_adv_group_fraction: float) -> str:
        return "the teacher scored no token (every episode failed, or none made a trainable call)"


class DynamicDistillation(Distillation, DynamicSampling):
    """Distillation over the groups dynamic sampling kept (groups whose rewards differ)."""


class OfflineSFT:
    """algorithm.type sft: the batch's conversations, their assistant tokens trained by the SFT loss. The batch
    is the data itself: nothing is rolled out."""

    objective: str  # the catalog's, set by choose_selection

    def __init__(self, settings) -> None:
        self.settings = settings

    def gather(self, stages, tasks: list, batches, step: int, epoch: int, position: int,
               progress=None) -> Chosen:
        return Chosen([], tasks, epoch, position)

    def learn(self, chosen: Chosen, state, step: int) -> tuple[list[Sample], dict[str, float]]:
        first = chosen.position - len(chosen.kept)  # the uid names the row of the epoch's order
        return [x.as_sample(f"sft{first + i}") for i, x in enumerate(chosen.kept)], {}

    def report(self, step: int, chosen: Chosen, samples: list, train_metrics: dict[str, float],
               seconds: dict[str, float], extra: dict[str, float]) -> dict[str, float]:
        return {**{f"actor/{k}": v for k, v in train_metrics.items()}, "time/train_s": seconds["train"], **extra}

    def check_idle(self, state, chosen: Chosen, samples: list, step: int) -> None:
        """Every offline example carries a gradient."""

    def standing_warnings(self) -> list[str]:
        return []


class OfflinePreference(OfflineSFT):
    """algorithm.type dpo | orpo: the batch's (chosen, rejected) pairs, as a pair objective takes them (every
    chosen, then every rejected: algorithm/preference.py)."""

    def learn(self, chosen: Chosen, state, step: int) -> tuple[list[Sample], dict[str, float]]:
        from astuner.algorithm.preference import pair_samples

        return pair_samples(chosen.kept), {}


# The catalog's `selection` names -> (policy, policy with dynamic sampling); offline data has no dynamic sampling.
SELECTIONS = {
    "policy_gradient": (Plain, DynamicSampling),
    "rejection_sampling": (RejectionSampling, DynamicRejectionSampling),
    "distillation": (Distillation, DynamicDistillation),
    "offline_sft": (OfflineSFT, OfflineSFT),
    "offline_pairs": (OfflinePreference, OfflinePreference),
}


def choose_selection(settings):
    """The policy the catalog names for `settings.algorithm`, training the catalog's objective."""
    kind = algorithm(settings.algorithm)
    plain, dynamic = SELECTIONS[kind.selection]
    policy = (dynamic if settings.filter_groups and not kind.offline else plain)(settings)
    policy.objective = kind.objective
    return policy
