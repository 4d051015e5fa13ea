"""LLMJudge: an auxiliary model grades the response against the task with a rubric.

    task_judge: {judge_protocol: astuner.task_judge.llm_judge->LLMJudge}      # args via task_judge.combine
    auxiliary_models: {judge: {base_url: ..., api_key_env: ..., model_name: ...}}   (or model_path)

The judge model gets RUBRIC (or `rubric`, with the same {question}, {reference}, {response} and {max_score}
fields) and must end with "Score: N". `parse_score` reads the last score it wrote in any of these forms:
"Score: 7", "score = 7.5", "7/10", "\\boxed{7}", "**Score**: 7"; a score outside [0, max_score] is clamped.
An answer without a score, or a failed call, is retried (`retries` times) while the deadline (`timeout` seconds
for the whole judgement) allows; then the judge raises and the episode is flagged failed rather than trained on
a made-up reward.
    reward = score / max_score,   is_success = reward >= success_threshold
The judge model's full answer is kept in the trajectory (output metadata "judge_reasoning") and the score is
logged as the metric judge/score.
"""

from __future__ import annotations

import re
import time
from typing import Any

from astuner.errors import UserError
from astuner.task_judge.base_judge import BaseJudge
from astuner.workflow import WorkflowOutput, WorkflowTask

RUBRIC = """You grade answers. Compare the response with the reference answer (if any) and the question.
Question:
{question}

Reference answer:
{reference}

Response to grade:
{response}

Explain briefly, then end with a line "Score: N" where N is a number from 0 (wrong) to {max_score} (fully correct)."""

_PATTERNS = (
    re.compile(r"\*{0,2}score\*{0,2}\s*[:=]\s*\*{0,2}\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}"),
    re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)"),
)


def parse_score(text: str, max_score: float) -> float | None:
    """The last score in `text` (forms in the module docstring), clamped to [0, max_score]; None if none."""
    best: tuple[int, float] | None = None
    for pattern in _PATTERNS:
        for match in pattern.finditer(text or ""):
            value = float(match.group(1))
            if pattern is _PATTERNS[2]:
                denominator = float(match.group(2))
                if denominator <= 0:
                    continue
                value = value / denominator * max_score
            if best is None or match.start() >= best[0]:
                best = (match.start(), value)
    if best is None:
        return None
    return min(max(best[1], 0.0), max_score)


def response_text(output: WorkflowOutput) -> str:
    from astuner.task_judge.shaping import final_text

    return final_text(output)


class LLMJudge(BaseJudge):
    def __init__(self, config: Any = None, model: str = "judge", rubric: str | None = None, max_score: float = 10,
                 retries: int = 2, timeout: float = 120.0, success_threshold: float = 0.5) -> None:
        super().__init__(config)
        self.model, self.rubric, self.max_score = model, rubric or RUBRIC, float(max_score)
        self.retries, self.timeout, self.success_threshold = int(retries), float(timeout), float(success_threshold)
        for field_name in ("{response}",):
            if field_name not in self.rubric:
                raise UserError(f"LLMJudge: the rubric must contain {field_name}")

    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        import asyncio

        models = workflow_task.auxiliary_models
        if self.model not in models:
            raise UserError(f"LLMJudge: no auxiliary model named {self.model!r}; configure "
                            f"astuner.auxiliary_models.{self.model} (available: {', '.join(models) or 'none'})")
        task = workflow_task.task
        reference = next((str(task.metadata[k]) for k in ("answer", "ground_truth", "solution")
                          if task.metadata.get(k) not in (None, "")), "(none)")
        prompt = self.rubric.format(question=task.main_query, reference=reference,
                                    response=response_text(workflow_output), max_score=f"{self.max_score:g}")
        deadline = time.monotonic() + self.timeout
        answers, last_error = [], None
        for _ in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                reply = await asyncio.wait_for(models[self.model].chat([{"role": "user", "content": prompt}]), left)
            except Exception as exc:  # noqa: BLE001 - a failed call is retried like an unparsable one
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            text = reply.get("content") or ""
            answers.append(text)
            score = parse_score(text, self.max_score)
            if score is not None:
                workflow_output.metadata["judge_reasoning"] = text
                workflow_output.metrics["judge/score"] = score
                reward = score / self.max_score
                return reward, reward >= self.success_threshold
        workflow_output.metadata["judge_reasoning"] = "\n---\n".join(answers)
        raise RuntimeError(f"LLMJudge: no score from auxiliary model {self.model!r} after {len(answers)} answer(s)"
                           f" within {self.timeout:g}s" + (f"; last error {last_error}" if last_error else ""))
