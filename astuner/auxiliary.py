"""Auxiliary models: frozen chat models a workflow or judge may call (`astuner.auxiliary_models`).

Each entry is either served by astuner (`model_path`: a second engine with its own tokenizer and chat format,
never trained) or an OpenAI-compatible endpoint (`base_url`, the key read from the environment variable named by
`api_key_env` at call time, so it never reaches a log or the saved config). Either way the workflow and the
judge get an object with the interface of `model`: `await m(messages, tools=...)` returns an AgentScope
`ChatResponse`, `await m.chat(messages, tools)` an OpenAI-shaped message. Their calls are never samples; each
episode logs `aux/<name>/calls` and `aux/<name>/tokens`. A model served by astuner stops at the episode's
deadline while the workflow runs, and at the judge's (`task_judge.timeout` from when judging starts) once the
episode is being judged (`judging_deadline`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from astuner.errors import UserError
from astuner.http_body import tls_context
from astuner.tokenizer import load_tokenizer, stop_token_ids

KEY = "astuner.auxiliary_models"


class EndpointChatModel:
    """An OpenAI-compatible endpoint with ModelTuner's interface (`__call__` for AgentScope, `chat`)."""

    stream = False

    def __init__(self, name: str, section, usage: dict[str, float]) -> None:
        self.name = name
        self.section = section
        self.model_name = section.model_name or name
        self.usage = usage

    def _client(self):
        import openai

        key = os.environ.get(self.section.api_key_env, "") if self.section.api_key_env else "unused"
        return openai.AsyncOpenAI(base_url=self.section.base_url, api_key=key or "unused",
                                  timeout=self.section.timeout, max_retries=2,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=tls_context()))

    async def _create(self, messages: list[dict], tools: list[dict] | None) -> Any:
        kwargs: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                  "temperature": self.section.temperature, "max_tokens": self.section.max_tokens}
        if tools:
            kwargs["tools"] = tools
        async with self._client() as client:  # closed per call: episodes run on short-lived event loops
            response = await client.chat.completions.create(**kwargs)
        self.usage["calls"] += 1
        self.usage["tokens"] += float(getattr(response.usage, "completion_tokens", 0) or 0)
        return response.choices[0].message

    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return (await self._create(messages, tools)).model_dump(exclude_none=True)

    async def __call__(self, messages: list[dict], tools: list[dict] | None = None, tool_choice=None, **kwargs):
        from agentscope.message import TextBlock, ToolUseBlock
        from agentscope.model import ChatResponse

        message = await self._create(messages, None if tool_choice == "none" else tools)
        blocks: list = []
        if message.content or not message.tool_calls:
            blocks.append(TextBlock(type="text", text=message.content or ""))
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = {}
            blocks.append(ToolUseBlock(type="tool_use", id=call.id, name=call.function.name, input=arguments,
                                       raw_input=call.function.arguments or ""))
        return ChatResponse(content=blocks)


class AuxiliaryPool:
    """The configured auxiliary models; `for_episode()` hands out the per-episode objects."""

    def __init__(self, typed, loaded_engines: dict[str, tuple] | None = None) -> None:
        self.sections = dict(typed.astuner.auxiliary_models)
        self.served: dict[str, tuple] = loaded_engines or {}  # name -> (engine, tokenizer, renderer, parser, stops)

    @classmethod
    def build(cls, typed, max_model_len_of) -> "AuxiliaryPool":
        """Check every entry (and load the locally served ones); `max_model_len_of(path)` resolves a length
        (`auxiliary_pool`: the model's own)."""
        from astuner.model_tuner import ChatRenderer, detect_formats
        from astuner.model_tuner.formats import template_source
        from astuner.model_tuner.tool_parser import TOOL_PARSERS

        served = {}
        for name, section in typed.astuner.auxiliary_models.items():
            where = f"{KEY}.{name}"
            if bool(section.model_path) == bool(section.base_url):
                raise UserError(f"{where}: set exactly one of model_path (served by astuner) and base_url (an "
                                "OpenAI-compatible endpoint)")
            if section.base_url:
                if section.api_key_env and section.api_key_env not in os.environ:
                    raise UserError(f"{where}.api_key_env: the environment variable {section.api_key_env!r} is not "
                                    "set; export it before the run (the key is never written to the config)")
                continue
            from astuner.engine.hf_engine import HFEngine
            from astuner.model_cache import ModelPathError, resolve_model_path

            try:
                path = resolve_model_path(section.model_path)
            except ModelPathError as exc:
                raise UserError(f"{where}.model_path: {exc}") from None
            tokenizer = load_tokenizer(path)
            renderer = ChatRenderer(tokenizer)
            fmt = detect_formats(template_source(tokenizer), renderer.uses_builtin_tool_prompt)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            engine = HFEngine(path, max_batch_size=16, pad_token_id=pad)
            served[name] = (engine, tokenizer, renderer, TOOL_PARSERS[fmt.tool_parser](),
                            stop_token_ids(path, tokenizer), max_model_len_of(path))
        return cls(typed, served)

    def for_episode(self, episode_uid: str, deadline: float | None) -> tuple[dict[str, Any], dict[str, dict]]:
        """({name: chat model}, {name: usage counters}) for one episode."""
        from astuner.model_tuner import ModelTuner, TunerLimits

        models, usage = {}, {}
        for name, section in self.sections.items():
            usage[name] = {"calls": 0.0, "tokens": 0.0}
            if name in self.served:
                engine, tokenizer, renderer, parser, stops, max_len = self.served[name]
                models[name] = ModelTuner(
                    engine, tokenizer, renderer, parser,
                    TunerLimits(max_model_len=max_len, max_tokens_per_turn=section.max_tokens,
                                max_response_tokens=10**9, max_prompt_length=max_len),
                    section.temperature, stops, madness_checks=(), deadline=deadline,
                    episode_uid=f"{episode_uid}/aux:{name}")
            else:
                models[name] = EndpointChatModel(name, section, usage[name])
        return models, usage

    @staticmethod
    def metrics(models: dict[str, Any], usage: dict[str, dict]) -> dict[str, float]:
        out = {}
        for name, model in models.items():
            counts = usage[name]
            if hasattr(model, "calls"):  # served by astuner: its own record
                counts = {"calls": float(len(model.calls)),
                          "tokens": float(sum(len(c.response_ids) for c in model.calls))}
            out[f"aux/{name}/calls"] = counts["calls"]
            out[f"aux/{name}/tokens"] = counts["tokens"]
        return out

    def shutdown(self) -> None:
        for engine, *_ in self.served.values():
            engine.shutdown()


def judging_deadline(models: dict[str, Any], deadline: float) -> None:
    """From here on the episode's models served by astuner stop at `deadline` (time.monotonic()), the judge's,
    not at the episode's: an episode that used most of its time is still judged in full. (Endpoint models have
    only their own per-call timeout.)"""
    for model in models.values():
        if hasattr(model, "deadline"):
            model.deadline = deadline


def auxiliary_pool(typed) -> AuxiliaryPool | None:
    """The auxiliary models (astuner.auxiliary_models), checked and loaded, each at its own context length; None
    when there are none."""
    if not typed.astuner.auxiliary_models:
        return None
    from astuner import preflight

    return AuxiliaryPool.build(
        typed, lambda path: preflight.resolve_max_model_len(None, preflight.read_model_facts(path, "auxiliary model")))
