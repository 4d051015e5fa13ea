"""The user-facing workflow API, the loader for `module->Class` strings (`load_class`, `load_user_class`) and
the run's workflow from the config (`load_workflow`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astuner.errors import UserError, user_code_error
from astuner.logs import debug_from_user_modules
from astuner.types import Task

if TYPE_CHECKING:
    from astuner.model_tuner import ModelTuner


@dataclass
class WorkflowTask:
    """What a workflow receives for one episode."""

    task: Task
    repeat_index: int = 0
    episode_uid: str = ""
    is_validation: bool = False
    # The episode's frozen auxiliary models by name (astuner.auxiliary_models); also model_tuner.auxiliary_models.
    auxiliary_models: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkflowOutput:
    """What a workflow returns. reward=None lets the configured judge score it.

    response: the agent's answer (e.g. an AgentScope `Msg`), handed to a function judge as `response`.
    metrics: numbers to log for this episode (their mean per step is logged as `<split>/metrics/<name>`).
    stats: filled by astuner before judging: {"calls": LLM calls, "response_tokens": tokens generated,
        "summary_tokens": tokens of the summaries rollout.context_policy=summarize asked for}.
    agent_rewards: {agent name: reward} for agents rewarded apart from the episode (a judge may set them too);
        the calls of an agent listed here train with its own reward, the others with the episode's.
    """

    reward: float | None = None
    is_success: bool | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    agent_rewards: dict[str, float] = field(default_factory=dict)


@dataclass
class JudgeOutput:
    """What a function judge returns: the reward, optional metrics to log, and success (default: reward > 0)."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    is_success: bool | None = None


def task_dict(task: Task) -> dict[str, Any]:
    """The task as a function workflow or judge sees it: the dataset row, plus task_id and query."""
    return {**task.metadata, "task_id": task.task_id, "query": task.main_query}


def function_workflow(fn) -> type:
    """A Workflow class running `async def fn(task: dict, model, auxiliary_models) -> WorkflowOutput`; with
    astuner.agents, `model` is {agent name: that agent's model}.

    `model` is the chat model of the installed AgentScope line: the ModelTuner itself for 1.x (a 1.x chat model),
    AgentScope 2.x's own `OpenAIChatModel` served by the episode for 2.x (model_tuner/frontends/agentscope2.py)."""
    from astuner.model_tuner.frontends.agentscope2 import agentscope_major

    agentscope2 = (agentscope_major() or 0) >= 2

    class FunctionWorkflow(Workflow):
        name = getattr(fn, "__qualname__", "function_workflow")

        async def execute(self, workflow_task: WorkflowTask, model_tuner) -> WorkflowOutput:
            if model_tuner.roster.agents:  # astuner.agents: each named agent's own model
                agents = {name: model_tuner.for_agent(name) for name in model_tuner.roster.agents}
                model = {name: m.agentscope_model() if agentscope2 else m for name, m in agents.items()}
            else:
                model = model_tuner.agentscope_model() if agentscope2 else model_tuner
            result = await fn(task_dict(workflow_task.task), model, workflow_task.auxiliary_models)
            if not isinstance(result, WorkflowOutput):
                raise TypeError(f"{self.name} returned {type(result).__name__}, expected WorkflowOutput")
            return result

    FunctionWorkflow.__qualname__ = f"FunctionWorkflow[{FunctionWorkflow.name}]"
    return FunctionWorkflow


class Workflow:
    """Subclass this and implement `execute`. A fresh instance runs each episode."""

    name: str = "workflow"
    # Which part a failed or timed-out episode blames in the run's stop message (selection.FIX_ADVICE's keys).
    error_source: str = "workflow"

    def __init__(self, config: Any = None) -> None:
        self.config = config

    async def execute(self, workflow_task: WorkflowTask, model_tuner: "ModelTuner") -> WorkflowOutput:
        raise NotImplementedError


class ClassSpecError(ValueError):
    """A `module->Class` string that cannot be resolved."""


def load_class(spec: str, search_dirs: list[Path] | None = None) -> type:
    """Resolve "pkg.module->Class" or "path/to/file.py->Class".

    Module names are imported with `search_dirs` (e.g. the YAML's folder) tried first on sys.path;
    file paths are tried relative to each of `search_dirs`, then the working directory. A `.pkl` file holds
    functions that `tune()` shipped by value from a script (a dict of name -> function).
    """
    if not isinstance(spec, str) or "->" not in spec:
        raise ClassSpecError(f"expected 'pkg.module->Class' or 'path/file.py->Class', got {spec!r}")
    target, class_name = (part.strip() for part in spec.rsplit("->", 1))
    dirs = [Path(d).resolve() for d in (search_dirs or [])] + [Path.cwd()]
    if target.endswith(".pkl"):
        return _load_shipped(target, class_name, dirs, spec)
    if target.endswith(".py") or "/" in target:
        module = _load_file(target, dirs, spec)
    else:
        module = _import_module(target, dirs, spec)
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ClassSpecError(missing_name_message(spec, target, module, class_name)) from None


def missing_name_message(spec: str, target: str, module, name: str) -> str:
    """What a `target->name` that names nothing in its module says: the user's file (as written and resolved,
    never the internal module name a file is loaded under), the closest name it defines, and what it defines,
    workflows and judges first."""
    from astuner.config.validate import closest_name

    where = getattr(module, "__file__", None)
    place = f"{target} ({Path(where).resolve()})" if where else target
    agents, others = defined_names(module)
    public = [n for n in dir(module) if not n.startswith("_")]
    hint = closest_name(name, agents + others) or closest_name(name, public)
    text = f"{spec!r}: {place} defines no {name!r}"
    text += f"; did you mean {hint!r}?" if hint else "."
    if agents:
        text += f" Its workflows and judges: {_names(agents)}."
    if others:
        text += f" {'Its other' if agents else 'Its'} classes and functions: {_names(others)}."
    if not agents and not others:
        text += " It defines no class or function of its own."
    return text + f" Write '{target}->Name' with a name it defines."


def _names(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def defined_names(module) -> tuple[list[str], list[str]]:
    """(workflows and judges, other classes and functions) a module defines itself, not those it imports, each
    sorted. A workflow or judge: a Workflow subclass, a class with `compute_reward`, or an async function (a
    function workflow); a judge function is an ordinary function and lands in the second list."""
    import inspect

    agents, others = [], []
    for n, v in sorted(vars(module).items()):
        if n.startswith("_") or not (inspect.isclass(v) or inspect.isfunction(v)):
            continue
        if getattr(v, "__module__", None) != module.__name__:
            continue
        is_agent = (issubclass(v, Workflow) or callable(getattr(v, "compute_reward", None))) if inspect.isclass(v) \
            else inspect.iscoroutinefunction(v)
        (agents if is_agent else others).append(n)
    return agents, others


def _folders(dirs: list[Path]) -> str:
    """The folders searched, each once (the YAML's folder is often the working directory too)."""
    return ", ".join(dict.fromkeys(str(Path(d).resolve()) for d in dirs))


def _load_shipped(target: str, name: str, dirs: list[Path], spec: str):
    import pickle

    candidates = [Path(target)] if Path(target).is_absolute() else [d / target for d in dirs]
    for path in candidates:
        if path.is_file():
            shipped = pickle.loads(path.read_bytes())  # the user's own functions, written by tune()
            if name not in shipped:
                raise ClassSpecError(f"{spec!r}: {path} holds {', '.join(sorted(shipped))}, not {name!r}")
            return shipped[name]
    raise ClassSpecError(f"{spec!r}: file {target!r} not found (looked in {_folders(dirs)}); "
                         "on a multi-node cluster the run folder must be on storage every node reads")


def _load_file(target: str, dirs: list[Path], spec: str):
    candidates = [Path(target)] if Path(target).is_absolute() else [d / target for d in dirs]
    for path in candidates:
        if path.is_file():
            name = f"astuner_user_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                return sys.modules[name]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.parent))  # lets the file import its siblings
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            return module
    raise ClassSpecError(f"{spec!r}: file {target!r} not found (looked in {_folders(dirs)})")


def _import_module(target: str, dirs: list[Path], spec: str):
    for d in reversed(dirs):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target.startswith(exc.name):
            raise ClassSpecError(f"{spec!r}: no module named {target!r}") from None
        raise


def load_user_class(spec, base_dir: Path, what: str, key: str, base: type | None = None) -> type:
    if not spec:
        raise UserError(f"{key} is not set: name your {what} as 'pkg.module->Class' or 'path/file.py->Class'")
    try:
        cls = load_class(str(spec), [base_dir])
    except ClassSpecError as exc:
        raise UserError(f"{key}: {exc}") from None
    except Exception as exc:  # the user's module itself raised at import: show their traceback, not ours
        raise user_code_error(f"{key}: your {what} module", _module_file(str(spec), exc), exc) from None
    debug_from_user_modules(sys.modules.get(getattr(cls, "__module__", ""), None))  # its DEBUG: the log file
    if base is not None and not isinstance(cls, type) and inspect.isfunction(cls):
        return cls  # a function workflow or judge: the caller wraps it
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{key}: {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def _module_file(spec: str, exc: BaseException) -> str:
    """The user's file an import error came from: the innermost traceback frame outside astuner, else the spec."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith(str(Path(__file__).resolve().parent))]
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename
    return frames[0].filename if frames else spec.split("->")[0]


def workflow_spec(typed) -> str | None:
    """agentscope_workflow, or the environment's own workflow when it is null."""
    from astuner.environments import environment_of

    env = environment_of(typed.astuner.task_reader.type)
    spec = typed.astuner.rollout.agentscope_workflow
    return env.workflow if spec is None and env is not None else spec


def load_workflow(loaded):
    """The workflow class named by astuner.rollout.agentscope_workflow (a function is wrapped into one), or the one
    the caller gave in its place (`LoadedConfig.workflow`)."""
    if loaded.workflow is not None:
        return loaded.workflow
    typed = loaded.typed
    workflow_cls = load_user_class(
        workflow_spec(typed), loaded.config_dir, "workflow", "astuner.rollout.agentscope_workflow",
        Workflow,
    )
    if inspect.isfunction(workflow_cls):
        if not inspect.iscoroutinefunction(workflow_cls):
            raise UserError(
                f"astuner.rollout.agentscope_workflow: {workflow_cls.__qualname__} must be 'async def "
                f"{workflow_cls.__name__}(task, model, auxiliary_models)' (it awaits the model); it is a plain function."
            )
        workflow_cls = function_workflow(workflow_cls)
    if not inspect.iscoroutinefunction(workflow_cls.execute):
        raise UserError(
            f"astuner.rollout.agentscope_workflow: {workflow_cls.__qualname__}.execute must be 'async def execute("
            "self, workflow_task, model_tuner)' (it awaits the model); it is a plain function."
        )
    return workflow_cls
