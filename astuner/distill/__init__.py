"""On-policy distillation's teacher: built once per run where the loop runs (`build_teacher`), checked at start
(`check_teacher`), and the stage that scores a step's episodes (`scoring.score_episodes`). The math:
astuner/algorithm/distillation.py; the teachers: teachers.py."""

from __future__ import annotations

from astuner.errors import UserError


def _model_path(typed) -> str:
    from astuner.model_cache import ModelPathError, resolve_model_path

    try:
        return resolve_model_path(typed.astuner.teacher.model)
    except ModelPathError as exc:
        raise UserError(f"astuner.teacher.model: {exc}") from None


def _endpoint(typed):
    from astuner.distill.teachers import EndpointTeacher, TinkerTeacher

    t = typed.astuner.teacher
    if t.api == "tinker":
        return TinkerTeacher(t.base_url, t.served_model, t.api_key_env, t.timeout_s)
    return EndpointTeacher(t.base_url, t.served_model, t.api_key_env, t.timeout_s, t.batch_size)


def check_teacher(typed, tokenizer, student: str) -> None:
    """Before any weights load: the teacher reads the student's tokens (UserError, exit 2, naming both)."""
    from astuner.distill.teachers import check_model_vocabulary, check_vocabulary

    if typed.astuner.teacher.model is not None:
        check_model_vocabulary(tokenizer, _model_path(typed), student)
        return
    teacher = _endpoint(typed)
    try:
        if typed.astuner.teacher.api == "tinker":
            try:
                theirs = teacher.tokenizer()
            except Exception as exc:  # noqa: BLE001
                raise UserError(f"astuner.teacher: could not load the tokenizer of {teacher.name} to check that it "
                                f"reads the student's tokens ({type(exc).__name__}: {exc})") from None
            check_model_vocabulary(tokenizer, teacher.name, student, theirs, "astuner.teacher.served_model")
        else:
            check_vocabulary(teacher, tokenizer, student)
    finally:
        teacher.shutdown()


def build_teacher(typed, tokenizer, build_engine):
    """The run's teacher (teachers.py): a model folder on an engine in this process (`build_engine(typed, path,
    tokenizer, max_model_len)`, runtime's), or a server."""
    from astuner import preflight
    from astuner.distill.teachers import EngineTeacher

    t = typed.astuner.teacher
    if t.base_url is not None:
        return _endpoint(typed)
    path = _model_path(typed)
    max_model_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len,
                                                    preflight.read_model_facts(path, "astuner.teacher.model"), None)
    engine_typed = typed
    if t.engine is not None:
        rollout = typed.astuner.rollout.model_copy(update={"engine": t.engine})
        engine_typed = typed.model_copy(update={"astuner": typed.astuner.model_copy(update={"rollout": rollout})})
    return EngineTeacher(build_engine(engine_typed, path, tokenizer, max_model_len), t.timeout_s, path)
