"""The AgentScope side of ModelTuner: `ChatResponse` construction.

AgentScope is optional, so it is imported here, inside functions, only when an AgentScope agent calls the
tuner. The messages AgentScope's formatters produce (OpenAIChatFormatter, DashScopeChatFormatter) are already
OpenAI-shaped dicts; `chat_format` flattens their content parts, so nothing is converted on the way in.
"""

from __future__ import annotations

import json

from astuner.model_tuner.turn import Turn


def to_chat_response(turn: Turn):
    """An `agentscope.model.ChatResponse`: a text block (when there is text, or nothing else) then one
    `tool_use` block per parsed call, which ReActAgent executes with its toolkit."""
    from agentscope.message import TextBlock, ToolUseBlock
    from agentscope.model import ChatResponse
    from agentscope.model._model_usage import ChatUsage  # not re-exported by agentscope.model in 1.0.x

    blocks: list = []
    if turn.content or not turn.tool_calls:
        blocks.append(TextBlock(type="text", text=turn.content))
    for call in turn.tool_calls:
        blocks.append(
            ToolUseBlock(
                type="tool_use",
                id=call.id,
                name=call.name,
                input=call.arguments,
                raw_input=json.dumps(call.arguments, ensure_ascii=False),
            )
        )
    usage = ChatUsage(
        input_tokens=len(turn.call.prompt_ids),
        output_tokens=len(turn.call.response_ids),
        time=turn.seconds,
    )
    return ChatResponse(content=blocks, usage=usage)
