"""The policy's tokenizer and its end-of-turn ids, for every process that renders prompts or stops generation.

Below both the runtime builders and the auxiliary models, which load tokenizers the same way. transformers is
imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

from astuner.errors import UserError


def load_tokenizer(model_path: str, key: str = "astuner.model.path"):
    """The tokenizer of `model_path` (a UserError naming `key`, the config key that gave the path, when it cannot be
    loaded or has no chat template)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(
            f"{key}: cannot load a tokenizer from {model_path!r} ({' '.join(str(exc).split())[:300]}). "
            "Give a local Hugging Face model folder with its tokenizer files (tokenizer.json or tokenizer.model and "
            "tokenizer_config.json; there is no hub access at run time), or demo:smollm2-135m-instruct."
        ) from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f"{key}: the tokenizer of {model_path!r} has no chat template, so chat messages cannot be "
            "turned into prompts; use an instruct/chat model or add chat_template to tokenizer_config.json."
        )
    return tokenizer


def stop_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def check_same_tokenizer(tokenizer, path: str, key: str, *, other=None, template: bool = True,
                         whose: str = "the policy (astuner.model.path)",
                         remedy: str = "The models of a run share one tokenizer and chat template: pick models of "
                                       "one family") -> None:
    """UserError (exit 2) unless the model at `path` (its tokenizer `other`, else loaded from `path`, `key` the
    config key that named it) reads and writes `tokenizer`'s tokens: the same vocabulary and end-of-sequence token,
    and with `template` the same chat template (a model of the roster is prompted through the run's renderer; a
    teacher only scores token ids)."""
    other = other if other is not None else load_tokenizer(path, key)
    ours, theirs = tokenizer.get_vocab(), other.get_vocab()
    differs: dict[str, str] = {}
    if ours != theirs:
        only_ours, only_theirs = sorted(set(ours) - set(theirs))[:3], sorted(set(theirs) - set(ours))[:3]
        differs["vocabulary"] = (f"{len(theirs)} tokens against {len(ours)}"
                                 + (f", e.g. {only_ours} only in {whose}" if only_ours else "")
                                 + (f", {only_theirs} only in {path}" if only_theirs else ""))
    if template and tokenizer.chat_template != other.chat_template:
        differs["chat template"] = "another text around the messages"
    if tokenizer.eos_token != other.eos_token:
        differs["end-of-sequence token"] = f"{other.eos_token!r} against {tokenizer.eos_token!r}"
    if differs:
        raise UserError(f"{key}: {path} has another {' and '.join(differs)} than {whose}: "
                        f"{'; '.join(differs.values())}. {remedy}")
