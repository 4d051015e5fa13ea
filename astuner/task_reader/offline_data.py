"""Chat jsonl -> token ids with a mask on the assistant tokens, through the same renderer as the rollouts.

A conversation is rendered once, as the chat template writes it, and tokenized with character offsets. Assistant
message i owns the characters between
    A = render(messages[:i], generation prompt)    and    B = render(messages[:i + 1]),
cut after the end-of-turn marker (the model learns to stop; template glue after the marker is not trained).
The template must render the conversation turn by turn (A a prefix of B, B a prefix of the whole); one that
rewrites earlier turns (e.g. drops old reasoning) is refused with the message index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError
from astuner.types import Sample


@dataclass
class Example:
    """One conversation: ids, and 1 where the token belongs to an assistant turn."""

    ids: list[int]
    mask: list[int]

    def as_sample(self, uid: str) -> Sample:
        """A Sample whose prompt is everything before the first assistant token (the trainer predicts the rest)."""
        first = self.mask.index(1)
        last = len(self.mask) - self.mask[::-1].index(1)
        response = self.ids[first:last]
        return Sample(self.ids[:first], response, [0.0] * len(response), 1.0, 1.0, uid,
                      loss_mask=self.mask[first:last])


def tokenize_conversation(renderer, messages: list[dict], tools: list[dict] | None,
                          end_texts: tuple[str, ...]) -> Example:
    """Ids and assistant mask of one conversation (rules in the module docstring)."""
    if not messages or messages[0].get("role") == "assistant":
        raise ValueError("a conversation must start with a system or user message")
    full = renderer.render_text(messages, tools, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        a = renderer.render_text(messages[:i], tools)
        b = renderer.render_text(messages[: i + 1], tools, add_generation_prompt=False)
        if not (b.startswith(a) and full.startswith(b)):
            raise ValueError(f"the chat template does not render message {i} as an extension of the earlier turns, "
                             "so its tokens cannot be told apart")
        turn = b[len(a):]
        ends = [turn.rfind(t) + len(t) for t in end_texts if t and t in turn]
        spans.append((len(a), len(a) + (max(ends) if ends else len(turn))))
    if not spans:
        raise ValueError("no assistant message to learn from")
    encoded = renderer.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
    if not any(mask):
        raise ValueError("the assistant turns rendered to no tokens")
    return Example(ids, mask)


@dataclass
class Pair:
    chosen: Example
    rejected: Example


def _messages(row: dict, field: str, where: str) -> list[dict]:
    value = row.get(field)
    if isinstance(value, str):  # TRL also accepts a plain-text prompt / completion
        value = [{"role": "user" if field == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise UserError(f"{where}: field {field!r} must be a list of chat messages ({{'role': ..., 'content': ...}})")
    return value


def read_rows(path: Path, key: str) -> list[tuple[str, dict]]:
    """(location, row) of every row of a .jsonl, .json or .parquet file, read as the task reader reads its files;
    each row must be an object (`key`: the config key that names the file, for the messages)."""
    from astuner.task_reader.jsonl_reader import SUFFIXES, read_rows as file_rows

    if not path.is_file():
        raise UserError(f"{key}: {path} is not a file")
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"{key}: {path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    try:
        rows = list(file_rows(path))
    except UserError as exc:
        raise UserError(f"{key}: {exc}") from None
    for where, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{key}: {path}, {where}: expected a JSON object, got {type(row).__name__}")
    if not rows:
        raise UserError(f"{key}: {path} has no rows")
    return rows


def encode_rows(rows: list[tuple[str, dict]], path: Path, data: str, renderer, end_texts: tuple[str, ...], max_len: int,
                key: str) -> tuple[list, dict[str, int]]:
    """Examples (`data` "conversations") or Pairs ("pairs") of a jsonl file's rows, and counts of rows dropped for
    being too long.

    A row whose template cannot be split into turns, or that has no assistant message, is an error naming the
    line: training silently on part of a dataset is worse than stopping."""
    out: list = []
    dropped = {"too_long": 0}
    for location, row in rows:
        where = f"{key}: {path}, {location}"
        tools = row.get("tools")
        try:
            if data == "conversations":
                items = [tokenize_conversation(renderer, _messages(row, "messages", where), tools, end_texts)]
                item = items[0]
            else:
                prompt = _messages(row, "prompt", where)
                items = [tokenize_conversation(renderer, prompt + _messages(row, side, where), tools, end_texts)
                         for side in ("chosen", "rejected")]
                item = Pair(*items)
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
        if max(len(x.ids) for x in items) > max_len:
            dropped["too_long"] += 1
            continue
        out.append(item)
    if not out:
        raise UserError(f"{key}: every row of {path} is longer than max_model_len={max_len} tokens; raise "
                        "astuner.rollout.max_model_len or shorten the conversations")
    return out, dropped
