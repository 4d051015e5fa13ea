"""Judges score episodes whose workflow returned reward=None.

Built-ins, named in `astuner.task_judge.judge_protocol`:
  astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge   math equality via math_verify
  astuner.task_judge.exact_match_judge->ExactMatchJudge         normalised text equality
A custom judge subclasses `astuner.task_judge.base_judge.BaseJudge`. The built-in modules are not imported here,
so naming one loads only what it needs.
"""

from astuner.task_judge.base_judge import BaseJudge

__all__ = ["BaseJudge"]
