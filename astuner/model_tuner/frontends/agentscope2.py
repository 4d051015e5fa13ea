"""AgentScope 2.x: its own OpenAI chat model, pointed at the episode's endpoint, as the model an agent trains.

AgentScope 2.x replaced 1.x's `ReActAgent` with `Agent`, and its models take a `credential=` object. Its
`OpenAIChatModel` already speaks the OpenAI API, so astuner hands it the episode's key and serves it in-process
(the OpenAI route of gateway.py over an ASGI transport: no socket), and every call is recorded like any other.

    from agentscope.agent import Agent
    agent = Agent(name="assistant", system_prompt="...", model=model_tuner.agentscope_model(), toolkit=toolkit)

Or, unchanged agent code, with the loopback endpoint:
    OpenAIChatModel(credential=OpenAICredential(api_key=model_tuner.api_key, base_url=model_tuner.base_url), ...)

A `tune()` function workflow gets such a model as its `model` argument when AgentScope 2.x is installed (with
1.x it gets the ModelTuner, which is a 1.x chat model). The model also answers `model_tuner`, `base_url`,
`api_key` and `get_openai_client()` for code that wants the tuner itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from astuner.model_tuner.frontends.gateway import CLIENT_TIMEOUT_S, LOCAL_BASE_URL


def agentscope_major() -> int | None:
    """The installed AgentScope's major version, or None when it is not installed."""
    try:
        return int(importlib.metadata.version("agentscope").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def http_package_of(sdk_base_client) -> Any:
    """The HTTP package an SDK is built on (httpx, or httpx2 for the SDK releases that moved to it): its
    `http_client` argument accepts only that package's clients."""
    return importlib.import_module("httpx2" if hasattr(sdk_base_client, "httpx2") else "httpx")


def agentscope_model(model_tuner, stream: bool = False):
    """An `agentscope.model.OpenAIChatModel` (2.x) served in-process by the episode's gateway."""
    import openai._base_client
    from agentscope.credential import OpenAICredential
    from agentscope.model import OpenAIChatModel

    gateway = model_tuner.require_gateway()
    http = http_package_of(openai._base_client)
    client = http.AsyncClient(transport=http.ASGITransport(app=gateway.app), base_url=LOCAL_BASE_URL,
                              timeout=CLIENT_TIMEOUT_S)

    class TunedOpenAIChatModel(OpenAIChatModel):
        """AgentScope's own OpenAI model; what it cannot answer is asked of the episode's ModelTuner."""

        def __getattr__(self, name: str):
            if name == "model_tuner":  # not set yet (while AgentScope's __init__ runs)
                raise AttributeError(name)
            return getattr(self.model_tuner, name)

    model = TunedOpenAIChatModel(
        credential=OpenAICredential(api_key=model_tuner.api_key, base_url=LOCAL_BASE_URL),
        model=model_tuner.model_name, stream=stream,
        max_retries=0,  # a retried call would be a second sampled call in the record
        client_kwargs={"http_client": client, "max_retries": 0, "timeout": CLIENT_TIMEOUT_S})
    model.model_tuner = model_tuner
    return model
