"""The ways an agent reaches a ModelTuner other than its own `chat`: each turns a framework's or an API's request
into `ModelTuner.complete` and its answer back, so every call is recorded with exact token ids.

    gateway.py (+ gateway_openai, gateway_anthropic, gateway_http, gateway_calls)   the loopback HTTP server
    chat_completions_api.py, responses_api.py, anthropic_api.py                    the wire formats it speaks
    agentscope_adapter.py (AgentScope 1.x), agentscope2.py (2.x)                   in-process model classes

They use the tuner's public surface only: `complete`, `api_key_for`, `require_gateway`.
"""
