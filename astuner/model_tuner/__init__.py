"""The trainable model as the agent sees it: rendering, generation, tool-call parsing, call recording.

Importing this package does not import AgentScope (it is only needed when an AgentScope agent calls the tuner).
"""

from astuner.model_tuner.chat_format import ChatRenderer
from astuner.model_tuner.tool_parser import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedOutput,
    ParsedToolCall,
    get_tool_parser,
)
from astuner.model_tuner.formats import REASONING_PARSERS, ChatFormat, detect_formats
from astuner.model_tuner.tuner import AgentModel, ModelTuner, TunerLimits
from astuner.model_tuner.turn import CallOptions, EpisodeOverflow, EpisodeTimeout, Turn

__all__ = [
    "ModelTuner",
    "AgentModel",
    "CallOptions",
    "ChatFormat",
    "detect_formats",
    "REASONING_PARSERS",
    "TunerLimits",
    "EpisodeOverflow",
    "EpisodeTimeout",
    "Turn",
    "ChatRenderer",
    "TOOL_PARSERS",
    "HermesToolParser",
    "ParsedOutput",
    "ParsedToolCall",
    "get_tool_parser",
]
