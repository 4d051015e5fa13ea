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
