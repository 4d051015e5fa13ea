"""An engine for tutorial tests on the tiny random model, which cannot write a tool call by itself.

`ScriptedCalls` wraps the real HF engine: the first call of every episode (or each call whose index has a
script) answers with a scripted tool call, forced token by token and scored by the engine's own model (so the
recorded logprobs are the policy's, and the trainer agrees with them); every other call is sampled by the real
engine. Installed by replacing the `hf` entry of astuner's engine registry for one test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import re
from typing import Callable

import torch

from astuner.types import GenerateResult


class ScriptedCalls:
    def __init__(self, engine, tokenizer, script: Callable[[str], str] | dict[int, Callable[[str], str]]) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.scripts = script if isinstance(script, dict) else {0: script}  # call index -> script
        self.scripted = 0
        # Its own thread: the rollout's pool may be full of synchronous agents waiting for this very answer.
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scripted-score")

    def __getattr__(self, name):  # load_weights, abort, sleep, shutdown: the real engine's
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, sampling, request_id=None):
        # ModelTuner's request ids are "<episode uid>/<call index>/<tuner>": index 0 is the episode's first call.
        parts = (request_id or "").split("/")
        script = self.scripts.get(int(parts[1])) if len(parts) == 3 and parts[1].isdigit() else None
        if script is None or sampling.max_tokens <= 0:
            return await self.engine.generate(prompt_ids, sampling, request_id=request_id)
        prompt = self.tokenizer.decode(prompt_ids)
        # A script of two parameters also gets the request id (to tell an episode's repeats apart).
        text = script(prompt, request_id) if len(inspect.signature(script).parameters) == 2 else script(prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens - 1]
        ids.append(self.tokenizer.eos_token_id)
        logprobs = await asyncio.get_running_loop().run_in_executor(
            self._scorer, self._score, list(prompt_ids), ids, sampling.temperature)
        self.scripted += 1
        return GenerateResult(ids, logprobs, "stop")

    def _score(self, prompt_ids: list[int], ids: list[int], temperature: float) -> list[float]:
        model = self.engine.model
        with self.engine._model_lock, torch.no_grad():
            full = torch.tensor([prompt_ids + ids], device=model.device)
            logits = model(full).logits[0, len(prompt_ids) - 1 : -1].float()
            if temperature > 0:
                logits = logits / temperature
            logprobs = torch.log_softmax(logits, dim=-1)
            return logprobs.gather(1, torch.tensor(ids, device=model.device)[:, None])[:, 0].tolist()


def hermes_call(tool: str, argument: str, pattern: str) -> Callable[[str], str]:
    """A script writing one Hermes-format call to `tool`, its `argument` taken from the prompt by `pattern`."""

    def script(prompt: str) -> str:
        found = re.findall(pattern, prompt)
        value = found[-1] if found else ""
        return f'<tool_call>\n{{"name": "{tool}", "arguments": {{"{argument}": "{value}"}}}}\n</tool_call>'

    return script


def install(monkeypatch, script: Callable[[str], str] | dict[int, Callable[[str], str]]) -> list[ScriptedCalls]:
    """Make `astuner.rollout.engine: hf` build a ScriptedCalls around the HF engine; returns the engines
    built, so a test can count the scripted calls."""
    from astuner.engine.build import ENGINES

    built: list[ScriptedCalls] = []
    real = ENGINES["hf"]

    def factory(typed, model_path, tokenizer, *args):
        built.append(ScriptedCalls(real(typed, model_path, tokenizer, *args), tokenizer, script))
        return built[-1]

    monkeypatch.setitem(ENGINES, "hf", factory)
    return built


FRAMEWORKS_YAML = "tutorial/frameworks/frameworks.yaml"
LOOKUP_CALL = hermes_call("lookup_code", "name", r"access code of ([A-Z][a-z]+ [A-Z][a-z]+)\?")


def train_framework_agent(repo, tmp_path, tiny_model_dir, monkeypatch, workflow: str, steps: int,
                          extra: tuple[str, ...] = ()) -> list[dict]:
    """Train `workflow` of tutorial/frameworks/ for `steps` steps on the tiny model (first calls scripted) and
    check what every framework must do: no failed episode, the scripted call parsed and run, the tool's result sent
    back in a second call that starts with the first. Returns the training steps' metrics."""
    import json

    from astuner.cli import main

    engines = install(monkeypatch, LOOKUP_CALL)
    code = main(["--conf", str(repo / FRAMEWORKS_YAML), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}",
                 "astuner.rollout.engine=hf", f"astuner.rollout.agentscope_workflow='{workflow}'",
                 "astuner.data.train_batch_size=2", "astuner.rollout.num_repeat=2",
                 "astuner.rollout.max_response_length_in_one_turn=48", "astuner.rollout.max_model_len=2048",
                 "astuner.rollout.compute_madness_checklist=[]", "astuner.trainer_common.val_before_train=false",
                 f"astuner.trainer_common.total_training_steps={steps}", "astuner.trainer_common.test_freq=99",
                 "astuner.trainer_common.save_freq=99", "trinity.trainer.max_token_len_per_gpu=4096", *extra])
    assert code == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "train/failure_rate" in m]
    assert len(train) == steps and all(m["train/failure_rate"] == 0 for m in train)
    for step in range(1, steps + 1):
        episodes = [json.loads(line) for line in
                    (tmp_path / "trajectories" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(episodes) == 4 and not any(e["flags"] for e in episodes), [e["error_summary"] for e in episodes]
        for e in episodes:
            first, second = e["calls"][0], e["calls"][1]
            assert first["tool_calls"][0]["name"] == "lookup_code"
            assert "The access code of" in second["prompt"] and second["prompt"].startswith(first["prompt"])
    assert engines[0].scripted >= 4 * steps  # and the final validation's
    return train
