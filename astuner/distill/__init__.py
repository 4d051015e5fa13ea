"""On-policy distillation's teacher: built once per run where the loop runs (`build_teacher`), checked at start
(`prepare_teacher`), and the stage that scores a step's episodes (`scoring.score_episodes`). The math:
astuner/algorithm/distillation.py; the teachers: teachers.py."""

from __future__ import annotations

from astuner.errors import UserError


def teacher_path(typed) -> str:
    from astuner.model_cache import ModelPathError, resolve_model_path

    try:
        return resolve_model_path(typed.astuner.teacher.model)
    except ModelPathError as exc:
        raise UserError(f"astuner.teacher.model: {exc}") from None


def _endpoint(typed):
    """The teacher server of astuner.teacher, of the class its `api` names (teachers.TEACHER_APIS)."""
    from astuner.distill.teachers import TEACHER_APIS

    t = typed.astuner.teacher
    return TEACHER_APIS[t.api].from_section(t)


def check_endpoint_teacher(typed, tokenizer, student: str) -> None:
    """Before any weights load: a teacher server reads the student's tokens (UserError, exit 2, naming both)."""
    teacher = _endpoint(typed)
    try:
        teacher.check_tokens(tokenizer, student)
    finally:
        teacher.shutdown()


def prepare_teacher(typed, engine: str | None, tokenizer):
    """At start, before any weights load: the teacher reads the student's tokens. The facts of a model-folder
    teacher (preflight.ModelFacts), which the start-up plan counts (preflight.teacher_memory); None for a server.
    `engine`: the one a model-folder teacher scores on (config.derived.RunFacts.teacher_engine; None: a server)."""
    from astuner import preflight
    from astuner.distill.teachers import check_teacher_tokens

    student = typed.astuner.model.path
    if engine is None:
        check_endpoint_teacher(typed, tokenizer, student)
        return None
    path = teacher_path(typed)
    check_teacher_tokens(tokenizer, path, "astuner.teacher.model", student)
    return preflight.read_model_facts(path, "astuner.teacher.model")


def build_teacher(typed, tokenizer, build_engine, vllm_engines_here: int = 0):
    """The run's teacher (teachers.py): a model folder on an engine in this process (`build_engine(typed, path,
    tokenizer, max_model_len, engine=...)`, runtime's), or a server. `vllm_engines_here`: the vLLM engines this
    process already runs (the debug backbone's); on CUDA a vLLM teacher takes an equal part of
    astuner.rollout.gpu_memory_utilization beside them, as they took theirs (run_models.build_models counted it),
    where a whole share of its own would not fit beside theirs."""
    import torch

    from astuner import preflight
    from astuner.config.derived import gpu_share_per_engine, teacher_engine
    from astuner.distill.teachers import EngineTeacher

    t = typed.astuner.teacher
    if t.base_url is not None:
        return _endpoint(typed)
    path = teacher_path(typed)
    max_model_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len,
                                                    preflight.read_model_facts(path, "astuner.teacher.model"), None)
    name, share = teacher_engine(typed), None
    if name == "vllm":
        share = gpu_share_per_engine(typed, vllm_engines_here + 1, torch.cuda.is_available())
    engine = build_engine(typed, path, tokenizer, max_model_len, engine=name, gpu_share=share)
    return EngineTeacher(engine, t.timeout_s, path)
