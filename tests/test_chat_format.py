"""Chat rendering: builtin tool prompt on a template without tools, a tools-aware template, auto selection."""

from __future__ import annotations

import copy
import json

import pytest

from astuner.model_tuner.chat_format import ChatRenderer, flatten_content, normalize_ids, template_renders_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "execute_python_code",
            "description": "Run Python.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "text", "text": "What is 6*12?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0_0",
                "type": "function",
                "function": {"name": "execute_python_code", "arguments": json.dumps({"code": "print(6*12)"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0_0", "name": "execute_python_code", "content": "72\n"},
]

# A minimal ChatML template that renders tools, tool calls and tool messages natively.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[CALL {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_tokenizer(demo_tokenizer):
    tokenizer = copy.deepcopy(demo_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def template_ids(tokenizer, messages, tools=None):
    return normalize_ids(
        tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    )


def test_auto_picks_builtin_for_plain_chatml(demo_tokenizer):
    assert not template_renders_tools(demo_tokenizer)
    assert ChatRenderer(demo_tokenizer).uses_builtin_tool_prompt
    assert ChatRenderer(demo_tokenizer, "builtin").uses_builtin_tool_prompt
    assert not ChatRenderer(demo_tokenizer, "template").uses_builtin_tool_prompt


def test_auto_picks_template_when_it_renders_tools(tools_tokenizer):
    assert template_renders_tools(tools_tokenizer)
    assert not ChatRenderer(tools_tokenizer).uses_builtin_tool_prompt
    assert ChatRenderer(tools_tokenizer, "builtin").uses_builtin_tool_prompt


def test_invalid_mode_rejected(demo_tokenizer):
    with pytest.raises(ValueError, match="tool_prompt"):
        ChatRenderer(demo_tokenizer, "magic")


def test_builtin_mode_rewrites_tools_into_text(demo_tokenizer):
    renderer = ChatRenderer(demo_tokenizer, "builtin")
    ids = renderer.render(CONVERSATION, TOOLS)

    call = json.dumps({"name": "execute_python_code", "arguments": {"code": "print(6*12)"}})
    messages, tools = renderer.prepare(CONVERSATION, TOOLS)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("You are helpful.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[1]["content"] == "What is 6*12?"
    assert messages[2]["content"] == f"<tool_call>\n{call}\n</tool_call>"
    assert messages[3]["content"] == "<tool_response>\n72\n\n</tool_response>"
    # Exactly what the tokenizer's own template gives for the rewritten conversation.
    assert ids == template_ids(demo_tokenizer, messages)

    text = demo_tokenizer.decode(ids)
    assert '"name": "execute_python_code"' in text and "<tool_response>\n72" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_builtin_mode_creates_system_message_and_merges_parallel_results(demo_tokenizer):
    renderer = ChatRenderer(demo_tokenizer, "builtin")
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "two"},
    ]
    tools = [{"name": "f", "description": "bare function dict", "parameters": {"type": "object"}}]
    messages, _ = renderer.prepare(conversation, tools)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert messages[2]["content"].startswith("Two calls.\n<tool_call>\n")
    assert messages[2]["content"].count("<tool_call>") == 2
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>",
    }
    assert len(messages) == 4


def test_builtin_mode_without_tools_still_rewrites_tool_history(demo_tokenizer):
    renderer = ChatRenderer(demo_tokenizer, "builtin")
    messages, _ = renderer.prepare(CONVERSATION, None)
    assert "# Tools" not in messages[0]["content"]
    assert messages[3]["role"] == "user" and "<tool_response>" in messages[3]["content"]


@pytest.mark.parametrize("mode", ["builtin", "template", "auto"])
def test_without_tools_every_mode_just_applies_the_template(demo_tokenizer, mode):
    conversation = [
        {"role": "system", "content": [{"text": "Be brief."}]},  # DashScope-style part
        {"role": "user", "content": "2+2?", "name": "user"},
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert ChatRenderer(demo_tokenizer, mode).render(conversation) == template_ids(demo_tokenizer, plain)


def test_template_mode_passes_tools_and_structured_calls(tools_tokenizer):
    renderer = ChatRenderer(tools_tokenizer)
    ids = renderer.render(CONVERSATION, TOOLS)
    messages, tools = renderer.prepare(CONVERSATION, TOOLS)
    assert tools == TOOLS
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"code": "print(6*12)"}
    assert messages[3]["role"] == "tool" and messages[3]["tool_call_id"] == "call_0_0"
    assert ids == template_ids(tools_tokenizer, messages, TOOLS)

    text = tools_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nTOOLS:execute_python_code;")
    assert '[CALL execute_python_code {"code": "print(6*12)"}]' in text
    assert "<|im_start|>tool\n72\n" in text
    assert "<tool_call>" not in text


def test_flatten_content_and_normalize_ids():
    assert flatten_content(None) == ""
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]) == "a\nb"
    assert normalize_ids({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}) == [1, 2, 3]
    assert normalize_ids([4, 5]) == [4, 5]
