"""astuner: train LLM agents with reinforcement learning.

Public API (imported lazily so that `astuner --help` and the config module stay light):
    from astuner import ModelTuner, Workflow, WorkflowTask, WorkflowOutput
    from astuner import tune, JudgeOutput, DatasetConfig, TunerModelConfig, AlgorithmConfig, EnvConfig   (tune())
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Workflow": "astuner.workflow",
    "WorkflowTask": "astuner.workflow",
    "WorkflowOutput": "astuner.workflow",
    "ModelTuner": "astuner.model_tuner",
    "Task": "astuner.types",
    "JudgeOutput": "astuner.workflow",
    "tune": "astuner.tune_api",
    "DatasetConfig": "astuner.tune_api",
    "TunerModelConfig": "astuner.tune_api",
    "AlgorithmConfig": "astuner.tune_api",
    "AuxiliaryModelConfig": "astuner.tune_api",
    "EnvConfig": "astuner.tune_api",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'astuner' has no attribute {name!r}")
