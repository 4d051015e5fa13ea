"""The run's judge from `astuner.task_judge`: judge_protocol (a user class or function, or an environment's own
judge), or several combined (`combine`)."""

from __future__ import annotations

import inspect

from astuner.errors import UserError, user_code_error
from astuner.workflow import load_user_class


def judge_spec(typed) -> str:
    """judge_protocol, or the environment's own judge (astuner/environments/) when it is left at its default."""
    from astuner.config.schema import TaskJudgeSection
    from astuner.environments import environment_of

    env = environment_of(typed.astuner.task_reader.type)
    spec = typed.astuner.task_judge.judge_protocol
    if env is not None and spec == TaskJudgeSection.model_fields["judge_protocol"].default:
        return env.judge
    return spec


def build_judge(loaded):
    """The judge of `astuner.task_judge` (user classes resolve against the config's folder; a judge's
    constructor gets the composed config, as the seed's judges expect)."""
    from astuner.task_judge.base_judge import BaseJudge

    section, cfg, base_dir = loaded.typed.astuner.task_judge, loaded.cfg, loaded.config_dir
    if section.combine:
        from astuner.task_judge.shaping import build_combined_judge

        return build_combined_judge(
            section.combine, cfg,
            lambda spec, where: load_user_class(spec, base_dir, "judge", where, BaseJudge))
    key = "astuner.task_judge.judge_protocol"
    judge_cls = load_user_class(judge_spec(loaded.typed), base_dir, "judge", key, BaseJudge)
    if inspect.isfunction(judge_cls):
        from astuner.task_judge.base_judge import FunctionJudge

        return FunctionJudge(judge_cls, cfg)
    try:
        return judge_cls(cfg)
    except UserError:
        raise
    except Exception as exc:
        raise user_code_error(f"{key}: {judge_cls.__qualname__}.__init__ in", inspect.getfile(judge_cls), exc) from None
