"""Token-exact multi-turn: a call's prompt, reusing an earlier call's exact ids where the request extends it.

When a request's messages extend an earlier call's messages plus the assistant message that call returned, the
prompt is that call's exact prompt and response ids and only the new messages are rendered
(`ChatRenderer.render_extension`); otherwise the whole request is rendered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from astuner.model_tuner.chat_format import canonical_messages
from astuner.types import LLMCall


@dataclass
class Conversation:
    """What a later call needs to extend an earlier one token-exactly."""

    canonical: list  # canonical_messages(request) + the canonical assistant message handed back
    tools_key: str
    prompt_ids: list[int]
    response_ids: list[int]
    call: LLMCall | None = None  # the call that produced it (`discard` forgets both)
    prefill: str = ""  # the text its prompt ended with, in the assistant turn already begun (a prefill)


@dataclass
class Prompt:
    """A call's prompt ids, and what the episode remembers of it once the call is answered."""

    ids: list[int]
    extends: bool  # the ids extend an earlier call's exactly
    canonical: list  # canonical_messages(request)
    tools_key: str
    new_from: int  # index of the first message the extended call had not seen (0: it extends none)


def stop_texts(tokenizer, stop_token_ids) -> tuple[str, ...]:
    """The texts a turn the model ended may end with: each stop token's, and the tokenizer's EOS."""
    return tuple(
        tokenizer.decode([i], skip_special_tokens=False) for i in stop_token_ids
    ) + ((getattr(tokenizer, "eos_token", None) or ""),)


class Conversations:
    """The episode's answered calls, newest last, for later calls to extend."""

    def __init__(self, stop_texts: tuple[str, ...]) -> None:
        self.stop_texts = stop_texts
        self.items: list[Conversation] = []

    def prompt(self, renderer, reasoning_parser, messages: list[dict], tools: list[dict] | None,
               prefill: str = "") -> Prompt:
        """The prompt for these messages, extending the latest call they extend. With a `prefill`, the ids end in
        the assistant turn begun with it (ChatRenderer.prompt_text)."""
        canonical = canonical_messages(messages, reasoning_parser)
        tools_key = json.dumps(tools, sort_keys=True, ensure_ascii=False)
        for conv in reversed(self.items):
            k = len(conv.canonical)
            if conv.tools_key == tools_key and len(canonical) > k and canonical[:k] == conv.canonical:
                ids = renderer.render_extension(messages, tools, k, conv.prompt_ids, conv.response_ids,
                                                self.stop_texts, conv.prefill, prefill)
                if ids is not None:
                    return Prompt(ids, True, canonical, tools_key, k)
                break
        return Prompt(renderer.render(messages, tools, prefill), False, canonical, tools_key, 0)

    def remember(self, prompt: Prompt, reply: dict, reasoning_parser, response_ids: list[int], call: LLMCall,
                 prefill: str) -> None:
        """An answered call: its prompt, and the reply handed back, for a later call to extend."""
        self.items.append(Conversation(
            prompt.canonical + canonical_messages([reply], reasoning_parser),
            prompt.tools_key, list(prompt.ids), list(response_ids), call, prefill))

    def forget(self, call: LLMCall) -> None:
        """A discarded call: no later call extends it."""
        self.items = [c for c in self.items if c.call is not call]
