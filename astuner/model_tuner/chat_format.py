"""Rendering OpenAI-format messages (+ tool schemas) into prompt token ids.

Two ways to show tools to the model (`rollout.tool_prompt`):
  template  the tokenizer's own chat template receives `tools` and the messages as they are;
  builtin   astuner's tool prompt, for templates that cannot render tools (e.g. plain ChatML): the schemas and
            the `<tool_call>` answer format are appended to the system message, earlier tool calls become
            `<tool_call>` tags in the assistant text and tool results become user turns in `<tool_response>`
            tags. This is the Hermes convention, so the `hermes` parser reads the model's answers.
  auto      template when the template source mentions `tools`, else builtin.
"""

from __future__ import annotations

import json
import re
from typing import Any

from astuner.errors import UserError

TOOL_PROMPT_MODES = ("auto", "template", "builtin")

BUILTIN_TOOL_PROMPT = """# Tools

You can call functions to help with the task. Their JSON schemas are listed inside <tools></tools>:
<tools>
{schemas}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}
</tool_call>
You may make several calls in one answer, one tag pair each. Each result comes back inside \
<tool_response></tool_response> tags."""


def flatten_content(content: Any) -> str:
    """A message's content as one string: OpenAI parts ({"type": "text", "text"}) and DashScope parts ({"text"})
    are joined with newlines; non-text parts (images, audio) are dropped since only text reaches the tokenizer."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and part.get("text") is not None:
            texts.append(str(part["text"]))
    return "\n".join(texts)


def normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI tool schemas ({"type": "function", "function": {...}}); bare function dicts are wrapped."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if "function" in tool:
            out.append({"type": tool.get("type", "function"), "function": tool["function"]})
        elif "name" in tool:
            out.append({"type": "function", "function": tool})
        else:
            raise ValueError(f"tool schema without a function name: {tool!r}")
    return out


def tool_names_of(tools: list[dict] | None) -> set[str]:
    return {tool["function"]["name"] for tool in normalize_tools(tools) or []}


def read_tool_choice(tools: list[dict] | None, choice: Any) -> tuple[list[dict] | None, str | None]:
    """(tools to show, the call required) for an OpenAI or AgentScope `tool_choice`.

    "auto"/None: the tools as given, no call required. "none": no tools shown. "required" (AgentScope: "any"):
    some call is required, returned as "". A function ({"type": "function", "function": {"name": N}}, or N as
    a string): a call to N is required. Sampling is never constrained (the recorded logprobs must be the
    policy's own): the answer is checked instead (`tool_choice_violation`). A choice that names no offered tool
    raises ValueError naming it."""
    if choice in (None, "auto"):
        return tools or None, None
    if choice == "none":
        return None, None
    names = tool_names_of(tools)
    if choice in ("required", "any"):
        if not names:
            raise ValueError(f"tool_choice {choice!r} needs tools, and the request offers none")
        return tools, ""
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else choice
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"tool_choice {choice!r} is not 'auto', 'none', 'required' or a function among the "
                         f"offered tools ({', '.join(sorted(names)) or 'none offered'})")
    return tools, name


def tool_choice_violation(required: str | None, called: list[str]) -> str | None:
    """Why the calls made break the `tool_choice` (None when they keep it). `required`: as read_tool_choice."""
    if required is None:
        return None
    if not called:
        return "tool_choice required a tool call" + (f" to {required!r}" if required else "") + ", none was made"
    wrong = [n for n in called if n != required]
    if required and wrong:
        return f"tool_choice required a call to {required!r}, the model called {', '.join(map(repr, wrong))}"
    return None


def _arguments_as_object(arguments: Any) -> Any:
    """Tool-call arguments as a dict when they hold JSON (templates and the builtin prompt expect an object)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return {} if arguments is None else arguments


def _tool_calls_of(message: dict) -> list[dict]:
    """An assistant message's tool calls in OpenAI shape, arguments as objects."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = _arguments_as_object(function.get("arguments"))
        name = function.get("name")
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def canonical_messages(messages: list[dict], reasoning_parser=None) -> list[str]:
    """Messages reduced to what decides whether a conversation was sent back unchanged: role, text (an assistant
    turn without its reasoning, which OpenAI clients drop), tool calls as (name, arguments object), and a tool
    result's text. Compared as JSON strings."""
    out = []
    for message in messages:
        role = message.get("role")
        text = flatten_content(message.get("content"))
        if role == "assistant" and reasoning_parser is not None:
            text = reasoning_parser.split(text).content
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in _tool_calls_of(message)]
        out.append(json.dumps([role, text.strip(), calls], sort_keys=True, ensure_ascii=False))
    return out


def normalize_ids(encoded: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` returns a list, a nested list, a tensor or a BatchEncoding depending
    on the transformers version and flags; reduce all of them to one flat list of ints."""
    if hasattr(encoded, "keys") and "input_ids" in encoded.keys():
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"expected one tokenized conversation, got {len(encoded)}")
        encoded = list(encoded[0])
    return [int(i) for i in encoded]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template (any of its named variants) refers to `tools`."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        sources = list(template.values())
    elif isinstance(template, (list, tuple)):  # older serialisations: [{"name", "template"}]
        sources = [t.get("template", "") for t in template if isinstance(t, dict)]
    else:
        sources = [template or ""]
    return any(re.search(r"\btools\b", source or "") for source in sources)


class TemplateRefused(ValueError):
    """The chat template raised on these messages: the request's fault, refused with 400 by the endpoints."""


_PREFILL_END = "\u2063astuner-prefill-end\u2063"  # marks where a prefill's text ends in the rendered turn


class ChatRenderer:
    """Turns messages + tool schemas into the exact prompt ids the engine will see."""

    def __init__(self, tokenizer, tool_prompt: str = "auto") -> None:
        if tool_prompt not in TOOL_PROMPT_MODES:
            raise ValueError(f"tool_prompt must be one of {', '.join(TOOL_PROMPT_MODES)}, got {tool_prompt!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "astuner needs a chat (instruct) model or a tokenizer with a chat_template set"
            )
        self.tokenizer = tokenizer
        self.tool_prompt = tool_prompt
        if tool_prompt == "auto":
            self.uses_builtin_tool_prompt = not template_renders_tools(tokenizer)
        else:
            self.uses_builtin_tool_prompt = tool_prompt == "builtin"

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[dict], list[dict] | None]:
        """The (messages, tools) handed to `apply_chat_template`: contents flattened to strings and, in builtin
        mode, tools folded into the text. Exposed so tests and debugging can see what the template receives."""
        tools = normalize_tools(tools)
        if self.uses_builtin_tool_prompt:
            return self._builtin_messages(messages, tools), None
        return [self._template_message(m) for m in messages], tools

    def render(self, messages: list[dict], tools: list[dict] | None = None, prefill: str = "") -> list[int]:
        """The prompt's ids; with a `prefill`, the assistant turn already begun with that text (`prompt_text`)."""
        if prefill:
            return self.tokenizer.encode(self.prompt_text(messages, tools, prefill), add_special_tokens=False)
        template_messages, template_tools = self.prepare(messages, tools)
        encoded = self._apply(template_messages, template_tools, add_generation_prompt=True, tokenize=True)
        return normalize_ids(encoded)

    def render_text(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The conversation as the template writes it (logs, checks and the extension below; the ids of a
        first prompt always come from `render`)."""
        template_messages, template_tools = self.prepare(messages, tools)
        return self._apply(template_messages, template_tools, add_generation_prompt=add_generation_prompt,
                           tokenize=False)

    def prompt_text(self, messages: list[dict], tools: list[dict] | None, prefill: str = "") -> str:
        """The text of the prompt: the generation prompt after `messages`, or, with a `prefill` (the Messages
        API's final assistant message), the conversation with the prefill as a final assistant message, cut
        right after its text. That is transformers' `continue_final_message`: what precedes the prefill is what
        the template writes for a finished assistant turn (Qwen3.5's closed empty `<think>` block, not the
        generation prompt's open one, which would put the prefill inside the reasoning)."""
        if not prefill:
            return self.render_text(messages, tools)
        text = self.render_text([*messages, {"role": "assistant", "content": prefill + _PREFILL_END}], tools,
                                add_generation_prompt=False)
        at = text.rfind(_PREFILL_END)
        if at < 0 or not text[:at].endswith(prefill.strip()):
            raise TemplateRefused("the model's chat template does not write a final assistant message's text as "
                                  "it is, so the answer cannot continue it; send the conversation without a final "
                                  "assistant message")
        return text[:at]

    def _apply(self, messages: list[dict], tools: list[dict] | None, **kwargs):
        """`apply_chat_template`, its failures as TemplateRefused: a template raises whatever its code hits on
        input it does not expect (a TypeError on an int id as well as its own raise_exception)."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only the template runs here; our own code stays outside
            raise TemplateRefused(f"the model's chat template refused these messages: {type(exc).__name__}: "
                                  f"{exc}") from exc

    def render_extension(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        k: int,
        prev_ids: list[int],
        response_ids: list[int],
        stop_texts: tuple[str, ...],
        prev_prefill: str = "",
        prefill: str = "",
    ) -> list[int] | None:
        """Prompt ids for `messages` that reuse the exact ids of an earlier call, or None when they cannot.

        The earlier call saw `messages[:k-1]` (its prompt ids are `prev_ids`) and produced `response_ids`, which
        the agent sent back as `messages[k-1]`. With the template's texts
            A = prompt_text(messages[:k-1], prev_prefill)      (the earlier prompt)
            B = render(messages[:k],   no generation prompt)   (... plus the assistant turn)
            C = prompt_text(messages, prefill)                 (the new prompt)
        the template extends the conversation unchanged when A is a prefix of B and B a prefix of C. Then
            ids = prev_ids + response_ids + encode(closing + C[len(B):])
        where `closing` is what B writes after the end-of-turn marker the model generated (e.g. the newline
        after <|im_end|>); a response cut at max_tokens gets the marker itself too. Earlier turns are never
        decoded and re-encoded: the model is conditioned on exactly the tokens it produced.
        """
        try:
            a = self.prompt_text(messages[: k - 1], tools, prev_prefill)
            b = self.render_text(messages[:k], tools, add_generation_prompt=False)
            c = self.prompt_text(messages, tools, prefill)
        except Exception:  # a template that refuses a partial conversation: render the whole prompt instead
            return None
        if not (b.startswith(a) and c.startswith(b)):
            return None
        turn = b[len(a):]
        last = self.tokenizer.decode(response_ids[-1:], skip_special_tokens=False) if response_ids else ""
        if last and last in stop_texts:
            at = turn.rfind(last)
            if at < 0:
                return None
            closing = turn[at + len(last):]
        else:
            found = [(turn.rfind(t), t) for t in stop_texts if t and t in turn]
            if not found:
                return None
            closing = turn[max(found)[0]:]
        suffix = closing + c[len(b):]
        return list(prev_ids) + list(response_ids) + self.tokenizer.encode(suffix, add_special_tokens=False)

    # --- template mode -------------------------------------------------------------------------------------
    @staticmethod
    def _template_message(message: dict) -> dict:
        out = {"role": message["role"], "content": flatten_content(message.get("content"))}
        if message["role"] == "assistant" and message.get("reasoning_content"):
            # Templates with reasoning (Qwen3) keep it in turns after the last user message; without it they
            # render those turns differently from what the model wrote.
            out["reasoning_content"] = str(message["reasoning_content"])
        if message.get("tool_calls"):
            out["tool_calls"] = _tool_calls_of(message)
        if message["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    out[key] = message[key]
        return out

    # --- builtin mode --------------------------------------------------------------------------------------
    def _builtin_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        for message in messages:
            role = message["role"]
            text = flatten_content(message.get("content"))
            if role == "tool":
                block = f"<tool_response>\n{text}\n</tool_response>"
                previous = out[-1] if out else None
                if previous is not None and previous.get("_tool_results"):
                    # Results of one parallel call batch share a single user turn, as in the Hermes format.
                    previous["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool_results": True})
                continue
            if role == "assistant" and message.get("tool_calls"):
                tags = [
                    "<tool_call>\n"
                    + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False)
                    + "\n</tool_call>"
                    for c in _tool_calls_of(message)
                ]
                text = "\n".join(([text] if text else []) + tags)
            out.append({"role": role, "content": text})
        for message in out:
            message.pop("_tool_results", None)
        if tools:
            prompt = BUILTIN_TOOL_PROMPT.format(schemas="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                system = out[0]["content"]
                out[0]["content"] = f"{system}\n\n{prompt}" if system else prompt
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out
