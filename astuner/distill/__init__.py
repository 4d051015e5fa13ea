"""On-policy distillation's teacher: built once per run where the loop runs (`build_teacher`), checked at start
(`check_teacher`), and the stage that scores a step's episodes (`scoring.score_episodes`). The math:
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
    from astuner.distill.teachers import EndpointTeacher, TinkerTeacher

    t = typed.astuner.teacher
    if t.api == "tinker":
        return TinkerTeacher(t.base_url, t.served_model, t.api_key_env, t.timeout_s)
    return EndpointTeacher(t.base_url, t.served_model, t.api_key_env, t.timeout_s, t.batch_size)


def check_teacher(typed, tokenizer, student: str) -> None:
    """Before any weights load: the teacher reads the student's tokens (UserError, exit 2, naming both)."""
    from astuner.distill.teachers import check_model_vocabulary, check_vocabulary

    if typed.astuner.teacher.model is not None:
        check_model_vocabulary(tokenizer, teacher_path(typed), student)
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


def prepare_teacher(typed, tokenizer, device_type, max_model_len: int) -> tuple[int, str] | None:
    """At start, before any weights load: the teacher reads the student's tokens (`check_teacher`), and what a
    model-folder teacher holds in memory for the start-up plan (`teacher_memory`; None for a server).
    `device_type()`: where the loop's process computes."""
    from astuner import preflight
    from astuner.config.derived import teacher_engine

    check_teacher(typed, tokenizer, typed.astuner.model.path)
    if teacher_engine(typed) is None:
        return None
    facts = preflight.read_model_facts(teacher_path(typed), "astuner.teacher.model")
    return teacher_memory(typed, facts, device_type(), max_model_len)


def build_teacher(typed, tokenizer, build_engine, vllm_engines_here: int = 0):
    """The run's teacher (teachers.py): a model folder on an engine in this process (`build_engine(typed, path,
    tokenizer, max_model_len)`, runtime's), or a server. `vllm_engines_here`: the vLLM engines this process already
    runs (the debug backbone's); on CUDA a vLLM teacher takes an equal part of astuner.rollout.gpu_memory_utilization
    beside them, as they took theirs (run_models.build_models counted it), where a whole share of its own would not
    fit beside theirs."""
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
    share = None
    if teacher_engine(typed) == "vllm":
        share = gpu_share_per_engine(typed, vllm_engines_here + 1, torch.cuda.is_available())
    engine = build_engine(typed, path, tokenizer, max_model_len, gpu_share=share, engine=t.engine)
    return EngineTeacher(engine, t.timeout_s, path)


def teacher_memory(typed, teacher, device: str, max_model_len: int) -> tuple[int, str]:
    """(bytes, a line saying what it holds) of a model-folder teacher (`teacher`: its preflight.ModelFacts) in the
    start-up plan (preflight.make_plan): the HF engine's fp32 weights (it loads fp32 everywhere); vLLM on
    CPU its fp32 weights, runtime and its own KV cache (`max_num_seqs` full-length sequences, as an engine started
    outside the memory fit takes: vllm_engine._cpu_kv_cache_bytes); vLLM on a GPU nothing more, since it takes its
    part of the run's share (distill.build_teacher)."""
    from astuner.config.derived import teacher_engine
    from astuner.preflight import GIB, VLLM_CPU_RUNTIME

    engine = teacher_engine(typed)
    held = 4 * teacher.num_params
    if engine == "vllm" and device == "cuda":
        held, where = 0, "its part of astuner.rollout.gpu_memory_utilization, split with the run's engines"
    elif engine == "vllm":
        from astuner.engine.vllm_engine import _cpu_kv_cache_bytes

        kv = _cpu_kv_cache_bytes(teacher.path, max_model_len, typed.astuner.rollout.max_num_seqs, "float32")
        held += VLLM_CPU_RUNTIME + kv
        where = f"fp32 weights, vLLM's runtime and a KV cache of {kv / GIB:.1f} GiB"
    else:
        where = "fp32 weights"
    return held, (f"{teacher.path} ({teacher.architecture}, {teacher.num_params / 1e6:.1f}M parameters) on {engine}: "
                  f"{held / GIB:.2f} GiB ({where})")

