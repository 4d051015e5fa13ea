"""Response ids -> the text the parsers read, with the chat format's own markers kept.

Some families write their tool or reasoning markers as special tokens: Llama 3.1's `<|python_tag|>`, Mistral's
`[TOOL_CALLS]` (both special in their tokenizers). Decoding with `skip_special_tokens=True` would hand the parser
a call without its marker, and a check for leaked special tokens would call the answer nonsense. So:
  - the parsers in use declare their markers (`markers` on each tool and reasoning parser);
  - response text keeps those markers and drops every other special token, as `skip_special_tokens` would;
  - only special tokens that are not markers count as leaked (`leak_ids`, for the `nonsense` check);
  - what the agent finally sees has any marker left outside a parsed call removed (`strip_markers`), as the
    family's own server does when it decodes with `skip_special_tokens=True`.
"""

from __future__ import annotations

from typing import Iterable


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (control tokens such as <|im_start|>): what
    `skip_special_tokens=True` drops."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids


class ResponseDecoder:
    def __init__(self, tokenizer, markers: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self.marker_ids: set[int] = set()
        for marker in dict.fromkeys(markers):
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in self.special_ids:
                self.marker_ids.add(ids[0])
        self.leak_ids = self.special_ids - self.marker_ids
        # Markers that are special tokens: a server decoding with skip_special_tokens never shows them.
        self.special_markers = tuple(tokenizer.decode([i], skip_special_tokens=False)
                                     for i in sorted(self.marker_ids))

    def decode(self, ids: list[int]) -> str:
        kept = [i for i in ids if i not in self.leak_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def strip_markers(self, text: str) -> str:
        for marker in self.special_markers:
            text = text.replace(marker, "")
        return text
