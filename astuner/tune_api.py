"""`tune()`: AgentScope Tuner's Python API over astuner's own config, checks and backbone.

    from astuner import tune, WorkflowOutput, JudgeOutput, DatasetConfig, TunerModelConfig, AlgorithmConfig
    tune(workflow_func=run_agent, judge_func=judge, model=TunerModelConfig(model_path=...),
         train_dataset=DatasetConfig(path="my_dataset", split="train"),
         algorithm=AlgorithmConfig(group_size=8, batch_size=32, learning_rate=1e-6))
    tune(workflow_func=run_agent, judge_func=judge, config_path="config.yaml")
    tune(env=EnvConfig("textarena", {"env_id": "GuessTheNumber-v0"}), algorithm=AlgorithmConfig(...))

An environment others wrote (`env`, astuner/environments/) brings its own tasks, workflow and judge: its kind is
the task reader's type and its arguments that reader's section, as in a YAML; `workflow_func` or `judge_func`, when
given too, replace the environment's own (an agent of yours answering its tasks).

The config objects become a YAML (written as `<project_name>.yaml` in the run folder), which goes through the
same compose, validation, start-up checks and backbone as `astuner --conf`: no second loop. The functions are
named in it as "module->function" (`__main__->run_agent` for a script), exactly as a YAML may name them. With a
Ray backbone (verl, trinity) the workers are other processes, where a script's `__main__` is not the user's
script: functions defined in the script are then shipped by value (pickled with Ray's cloudpickle, as Ray ships
a `__main__` function to its workers) into `<project_name>.functions.pkl` beside the YAML, which names them as
`<that file>->run_agent`. On a multi-node cluster that folder must be on storage every node reads.
Outputs go where the CLI puts them: `launcher_record/<project_name>/` under the working directory (with
`config_path`, the YAML's file name; or `experiment_dir`): config.yaml, astuner.log, metrics.jsonl, tensorboard/,
trajectories/, global_step_N/.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from astuner.config.backbones import backbone as backbone_record
from astuner.errors import UserError

ALGORITHMS = ("multi_step_grpo", "grpo")
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class DatasetConfig:
    """A dataset: a local .jsonl/.json/.parquet file, a local dataset folder (e.g. my_dataset/ with train.jsonl),
    or a `datasets` hub id already in the local cache."""

    path: str
    name: str | None = None
    split: str = "train"
    query_field: str = "question"
    task_id_field: str | None = None

    def is_file(self) -> bool:
        return Path(self.path).suffix in DATA_FILE_SUFFIXES

    def rows(self, n: int | None = None) -> list[dict]:
        from astuner.config.schema import TaskReaderSection
        from astuner.task_reader import TASK_READERS

        section = TaskReaderSection.model_validate(_reader_section(self, None), strict=False)
        tasks = TASK_READERS[section.type](section, Path.cwd()).training_tasks()
        return [t.metadata for t in (tasks if n is None else tasks[:n])]

    def preview(self, n: int = 5) -> list[dict]:
        """Print the first `n` rows (as the task reader reads them, so field errors show here) and return them."""
        rows = self.rows(n)
        where = self.path if self.is_file() else f"{self.path} (split {self.split})"
        print(f"{where}: first {len(rows)} rows")
        for i, row in enumerate(rows):
            text = ", ".join(f"{k}={_short(v)}" for k, v in row.items())
            print(f"  [{i}] {text}")
        return rows


@dataclass
class EnvConfig:
    """An environment others wrote: `kind` one of astuner.environments.ENVIRONMENTS (reasoning_gym, textarena),
    `args` the keys of that task reader's section (e.g. {"env_id": "GuessTheNumber-v0", "size": 256})."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TunerModelConfig:
    model_path: str = "demo:smollm2-135m-instruct"
    max_model_len: int | None = None
    temperature: float = 1.0
    # New tokens per call (rollout.max_response_length_in_one_turn); None: its default, 1024, or half of
    # max_model_len when that leaves no room for a prompt.
    max_tokens: int | None = None
    engine: str = "auto"  # rollout.engine: auto | vllm | hf


@dataclass
class AlgorithmConfig:
    algorithm_type: str = "multi_step_grpo"
    group_size: int = 8  # rollout.num_repeat
    batch_size: int = 32  # data.train_batch_size (tasks per step)
    learning_rate: float = 1e-6
    total_steps: int | None = None
    epochs: int = 1
    loss_agg_mode: str | None = None
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    use_kl_loss: bool | None = None
    kl_loss_coef: float | None = None
    # Any other key, dotted: {"rollout.max_env_worker": 16, "trainer_common.micro_batch_token_budget": 4096}.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AuxiliaryModelConfig:
    """A frozen model the workflow and judge may call: local weights (`model_path`) or an OpenAI-compatible
    endpoint (`base_url`, its key in the environment variable `api_key_env`: the key itself is never saved)."""

    model_path: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    model_name: str | None = None
    temperature: float = 0.0
    max_tokens: int = 512


def build_yaml(*, workflow_spec: str | None, judge_spec: str | None, model: TunerModelConfig | dict | None,
               train_dataset: DatasetConfig | None, eval_dataset: DatasetConfig | None,
               algorithm: AlgorithmConfig | None, project_name: str, experiment_dir: str | None,
               auxiliary_models: dict | None = None, env: EnvConfig | None = None) -> dict:
    """The astuner YAML (as a dict) for tune()'s config objects."""
    if env is not None:
        if train_dataset is not None or eval_dataset is not None:
            raise UserError("tune(): env= brings its own training and validation tasks; leave train_dataset and "
                            "eval_dataset out")
        reader = _env_section(env)
    elif train_dataset is None:
        raise UserError("tune(): give train_dataset=DatasetConfig(path=...), env=EnvConfig(...) or config_path=...")
    else:
        reader = _reader_section(train_dataset, eval_dataset)
    roster: dict[str, Any] = {}
    if isinstance(model, dict):
        model, roster = _per_agent_models(model)
    model = model or TunerModelConfig()
    algorithm = algorithm or AlgorithmConfig()
    if algorithm.algorithm_type not in ALGORITHMS:
        raise UserError(f"AlgorithmConfig.algorithm_type={algorithm.algorithm_type!r}: supported here are "
                        f"{', '.join(ALGORITHMS)} (GRPO over every LLM call of an episode)")
    astuner: dict[str, Any] = {
        "project_name": project_name,
        "model": {"path": model.model_path},
        "task_reader": reader,
        "data": {"train_batch_size": algorithm.batch_size},
        "rollout": {"agentscope_workflow": workflow_spec, "num_repeat": algorithm.group_size,
                    "temperature": model.temperature, "max_model_len": model.max_model_len, "engine": model.engine,
                    **({} if model.max_tokens is None else {"max_response_length_in_one_turn": model.max_tokens})},
        "trainer_common": {"optim": {"lr": algorithm.learning_rate}, "total_epochs": algorithm.epochs,
                           "total_training_steps": algorithm.total_steps,
                           "val_before_train": eval_dataset is not None or env is not None},
    }
    if judge_spec is not None:
        astuner["task_judge"] = {"judge_protocol": judge_spec}
    astuner.update(roster)
    if auxiliary_models:
        astuner["auxiliary_models"] = {
            str(name): {k: v for k, v in (asdict(m) if isinstance(m, AuxiliaryModelConfig) else dict(m)).items()
                        if v is not None}
            for name, m in auxiliary_models.items()}
    if experiment_dir is not None:
        astuner["experiment_dir"] = str(experiment_dir)
    trainer = astuner["trainer_common"]
    for name in ("loss_agg_mode", "clip_ratio_low", "clip_ratio_high", "use_kl_loss", "kl_loss_coef"):
        value = getattr(algorithm, name)
        if value is not None:
            trainer[name] = value
    tree: dict[str, Any] = {"astuner": astuner}
    for dotted, value in algorithm.extra.items():
        dotted = str(dotted)
        node = tree if dotted.startswith(("trinity.", "verl.")) else astuner
        *parents, leaf = dotted.removeprefix("astuner.").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _per_agent_models(models: dict) -> tuple[TunerModelConfig, dict[str, Any]]:
    """tune(model={agent: TunerModelConfig}): the first agent's model is the policy (it also serves any agent not
    named); every other agent gets a model of its own, named after it. Sampling settings are the run's, so they
    must agree."""
    if not models:
        raise UserError("tune(): model={} names no agent; give model=TunerModelConfig(...) or {agent: "
                        "TunerModelConfig(...), ...}")
    for name, m in models.items():
        if not isinstance(m, TunerModelConfig):
            raise UserError(f"tune(): model[{name!r}] must be a TunerModelConfig, got {type(m).__name__}")
    (first_name, first), *rest = models.items()
    shared = ("max_model_len", "temperature", "max_tokens", "engine")
    for name, m in rest:
        differ = [k for k in shared if getattr(m, k) != getattr(first, k)]
        if differ:
            raise UserError(f"tune(): model[{name!r}] sets {', '.join(differ)} unlike model[{first_name!r}]; the "
                            "rollout's sampling settings are one for the run, so give every model the same ones")
    return first, {
        "models": {str(name): {"path": m.model_path} for name, m in rest},
        "agents": {str(first_name): {"model": "policy"}, **{str(name): {"model": str(name)} for name, _ in rest}},
    }


def _env_section(env: EnvConfig) -> dict:
    """The task reader section of an environment: its kind checked here (the registry's names), its arguments by
    the config's schema, as a YAML's are."""
    from astuner.environments import ENVIRONMENTS

    if not isinstance(env, EnvConfig):
        raise UserError(f"tune(): env must be an EnvConfig(kind, args), got {type(env).__name__}")
    if env.kind not in ENVIRONMENTS:
        raise UserError(f"tune(): EnvConfig.kind={env.kind!r} is not an environment astuner plays; the kinds are "
                        f"{', '.join(sorted(ENVIRONMENTS))}")
    return {"type": env.kind, env.kind: dict(env.args)}


def _reader_section(train: DatasetConfig, val: DatasetConfig | None) -> dict:
    if train.is_file():
        section: dict[str, Any] = {"type": "jsonl_dataset_file", "jsonl_dataset_file": {
            "training": {"file_path": str(Path(train.path).resolve())}}}
        if val is not None:
            if not val.is_file():
                raise UserError("tune(): train_dataset is a file, so eval_dataset must be a file too")
            section["jsonl_dataset_file"]["validation"] = {"file_path": str(Path(val.path).resolve())}
    else:
        if val is not None and val.path != train.path:
            raise UserError("tune(): a dataset folder or hub id serves both splits; give eval_dataset the same path "
                            "with its own split")
        path = Path(train.path)
        section = {"type": "huggingface_dat_repo", "huggingface_dat_repo": {
            "dataset_path": str(path.resolve()) if path.exists() else train.path, "dataset_name": train.name,
            "training_split": train.split, "validation_split": None if val is None else val.split}}
    section["query_field"] = train.query_field
    section["task_id_field"] = train.task_id_field
    return section


def function_spec(fn: Callable, what: str) -> str:
    """ "module->function" for a module-level function (what a YAML would write)."""
    if not callable(fn) or not inspect.isfunction(fn):
        raise UserError(f"tune(): {what} must be a function, got {type(fn).__name__}")
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise UserError(f"tune(): {what} {fn.__qualname__!r} must be defined at module level (it is named in the "
                        "saved config as module->function)")
    if what == "workflow_func" and not inspect.iscoroutinefunction(fn):
        raise UserError(f"tune(): workflow_func {fn.__name__!r} must be 'async def {fn.__name__}(task, model, "
                        "auxiliary_models)'")
    return f"{fn.__module__}->{fn.__qualname__}"


def ship_functions(functions: dict[str, Callable], path: Path) -> Path:
    """Pickle `functions` by value (their code, and what of `__main__` they use) for Ray workers to load."""
    from ray import cloudpickle

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cloudpickle.dumps(functions))
    return path.resolve()


def tune(*, workflow_func: Callable | None = None, judge_func: Callable | None = None,
         model: TunerModelConfig | dict[str, TunerModelConfig] | None = None,
         train_dataset: DatasetConfig | None = None, eval_dataset: DatasetConfig | None = None,
         algorithm: AlgorithmConfig | None = None, config_path: str | None = None, project_name: str | None = None,
         experiment_dir: str | None = None, overrides: list[str] | None = None, backbone: str = "debug",
         auxiliary_models: dict[str, AuxiliaryModelConfig | dict] | None = None, with_ray: bool = False,
         env: EnvConfig | None = None) -> int:
    """Train `workflow_func` (judged by `judge_func`), or the environment `env` plays, and return the exit code
    astuner would (0 = trained).
    `with_ray` is the CLI's --with-ray: with backbone verl or trinity, start a local Ray cluster if none answers.
    `model` as {agent: TunerModelConfig}: one trained model per agent (the first is the policy), and
    `workflow_func` gets {agent: its model} as its `model` argument.

    Bad input raises `UserError` with the same one-paragraph message the CLI prints."""
    import yaml

    from astuner.launch import run

    if workflow_func is None and env is None and config_path is None:
        raise UserError("tune(): give workflow_func=your agent, or env=EnvConfig(...) for an environment others wrote")
    workflow_spec = None if workflow_func is None else function_spec(workflow_func, "workflow_func")
    judge_spec = None if judge_func is None else function_spec(judge_func, "judge_func")
    project_name = project_name or (env.kind if workflow_func is None and env is not None else
                                    getattr(workflow_func, "__name__", "tune"))
    folder = Path(experiment_dir) if experiment_dir else Path.cwd() / "launcher_record" / project_name
    # The YAML sits beside the run's other files; the launcher's resume logic decides the final folder.
    spec_dir = folder.parent / ".tune"
    if backbone_record(backbone).on_ray:
        local = [fn for fn in (workflow_func, judge_func) if fn is not None and fn.__module__ == "__main__"]
        if local:
            target = ship_functions({fn.__qualname__: fn for fn in local}, spec_dir / f"{project_name}.functions.pkl")
            if workflow_func in local:
                workflow_spec = f"{target}->{workflow_func.__qualname__}"
            if judge_func in local:
                judge_spec = f"{target}->{judge_func.__qualname__}"
    extra = [] if workflow_spec is None else [f"astuner.rollout.agentscope_workflow='{workflow_spec}'"]
    if judge_spec is not None:
        extra.append(f"astuner.task_judge.judge_protocol='{judge_spec}'")
    if config_path is not None:
        for name, m in (auxiliary_models or {}).items():
            fields = asdict(m) if isinstance(m, AuxiliaryModelConfig) else dict(m)
            extra += [f"+astuner.auxiliary_models.{name}.{k}={v}" for k, v in fields.items() if v is not None]
        run(str(config_path), backbone, extra + list(overrides or []), with_ray=with_ray)
        return 0
    tree = build_yaml(workflow_spec=workflow_spec, judge_spec=judge_spec, model=model, train_dataset=train_dataset,
                      eval_dataset=eval_dataset, algorithm=algorithm, project_name=project_name,
                      experiment_dir=experiment_dir, auxiliary_models=auxiliary_models, env=env)
    spec_dir.mkdir(parents=True, exist_ok=True)
    path = spec_dir / f"{project_name}.yaml"
    if experiment_dir is None:
        tree["astuner"]["experiment_dir"] = str(folder)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    run(str(path), backbone, list(overrides or []), with_ray=with_ray)
    return 0


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
