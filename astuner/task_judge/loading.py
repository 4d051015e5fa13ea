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

    def judge(spec: str, key: str, args: dict | None = None):
        target = load_user_class(spec, base_dir, "judge", key, BaseJudge)
        return instantiate_judge(target, cfg, key, args), target.__name__

    if not section.combine:
        return judge(judge_spec(loaded.typed), "astuner.task_judge.judge_protocol")[0]
    from astuner.task_judge.shaping import build_combined_judge

    return build_combined_judge(section.combine, cfg, judge)


def instantiate_judge(target, cfg, key: str, args: dict | None = None):
    """The judge of a user's class, `target(cfg, **args)`, or of a function (a `FunctionJudge`); an error its
    constructor raises is the user's, naming `key` and the file (exit 2), whether the judge is the run's one or a
    term of `combine`."""
    from astuner.task_judge.base_judge import FunctionJudge

    if inspect.isfunction(target):
        return FunctionJudge(target, cfg)
    args = args or {}
    try:  # arguments its constructor does not take are the config's mistake, not the class's
        inspect.signature(target).bind(cfg, **args)
    except TypeError as exc:
        raise UserError(f"{key}: {target.__qualname__} does not take the arguments {args} ({exc}); set "
                        f"`args` to what its constructor takes") from None
    except ValueError:  # no signature to read (a class built in C): its constructor tells
        pass
    try:
        return target(cfg, **args)
    except UserError:
        raise
    except Exception as exc:
        called = f"{target.__qualname__}.__init__" + (f" (with {args})" if args else "")
        raise user_code_error(f"{key}: {called} in", inspect.getfile(target), exc) from None
