"""Real tokenizers of the model families astuner claims, built offline from published vocabularies.

No hub at test time, so the vocabularies come from packages on the package index:
  llama3.1  `ggml-vocab-llama-bpe.gguf` (Llama 3's 128,256-token table, from the llama-cpp-python sdist) with the
            three reserved ids that Llama 3.1 named: 128004 <|finetune_right_pad_id|>, 128008 <|eom_id|>,
            128010 <|python_tag|> (all special, as in 3.1's tokenizer_config.json);
  qwen3.5   `ggml-vocab-qwen35.gguf` (Qwen's byte-level BPE and its three control tokens) with Qwen3's added-token
            table for ids 151646-151668, which that file leaves as padding: <tool_call>, <think> and the rest are
            added tokens with special=false there, vision markers special;
  gemma4    `ggml-vocab-gemma-4.gguf`: Gemma 4's 262,144 tokens, its merges and its own control tokens
            (<|tool_call>, <|"|>, <turn|>, ...);
  mistral   `tekken_240718.json` from mistral_common (Mistral Nemo's Tekken: 1,000 control tokens, [TOOL_CALLS]
            among them, then 130,072 byte-level ranks).
GGUF token types: 1 normal, 3 control (special=True), 4 user-defined (an added token with special=False), 6 byte.
Each tokenizer is built once with `tokenizers` and saved under the astuner cache.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

from gguf import GGUFValueType

GGUF_NORMAL, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_BYTE = 1, 3, 4, 6

LLAMA_31_RENAMES = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
# Qwen3's tokenizer_config.json, ids 151646.. (True: special).
QWEN3_ADDED = [
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
# Pre-tokenizer patterns of the byte-level families (llama.cpp's `tokenizer.ggml.pre` names them).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# family -> (vocabulary file, chat template file, eos token, extra end-of-turn tokens)
FAMILIES = {
    "llama3.1": ("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|eot_id|>",
                 ("<|eom_id|>",)),
    "qwen3.5": ("ggml-vocab-qwen35.gguf", "Qwen3.5-4B.jinja", "<|im_end|>", ()),
    "gemma4": ("ggml-vocab-gemma-4.gguf", "google-gemma-4-31B-it.jinja", "<turn|>", ("<|tool_response>",)),
    "mistral": ("tekken_240718.json", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>", ()),
}


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _add_table(tok, added: list[tuple[str, bool]]) -> None:
    """Register the tokens as added tokens (their ids are their vocabulary ids); special=True ones are what
    `skip_special_tokens` drops."""
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added])


# The struct code of each fixed-size GGUF value type (the gguf package's own enum of them).
_GGUF_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                 GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                 GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                 GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}


def gguf_metadata(path: Path) -> dict:
    """A GGUF file's key/value header ({key: value}, arrays as lists), tensors not read. `gguf.GGUFReader` maps
    every tensor and wraps each array element in numpy views: 8 s per vocabulary file on 2 cores, against 0.3 s
    for these few struct reads (the cold cache of a fresh CI machine builds four)."""
    data = path.read_bytes()
    magic, version, _, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF file of version 2 or later ({magic!r}, version {version})")
    pos = 24

    def string() -> str:
        nonlocal pos
        (size,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + size
        return data[pos - size:pos].decode("utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == GGUFValueType.STRING:
            return string()
        if kind == GGUFValueType.ARRAY:
            inner, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if inner in _GGUF_SCALARS:
                code = _GGUF_SCALARS[inner]
                items = list(struct.unpack_from(f"<{count}{code}", data, pos))
                pos += count * struct.calcsize(code)
                return items
            return [value(inner) for _ in range(count)]
        code = _GGUF_SCALARS[kind]
        (item,) = struct.unpack_from("<" + code, data, pos)
        pos += struct.calcsize(code)
        return item

    out = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        out[key] = value(kind)
    return out


def _from_gguf(path: Path, family: str):
    fields = gguf_metadata(path)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    if family == "llama3.1":
        for i, name in LLAMA_31_RENAMES.items():
            tokens[i], types[i] = name, GGUF_CONTROL
    if family == "qwen3.5":
        for offset, (name, special) in enumerate(QWEN3_ADDED):
            tokens[151646 + offset], types[151646 + offset] = name, GGUF_CONTROL if special else GGUF_USER_DEFINED
    vocab = {t: i for i, t in enumerate(tokens)}
    if family == "gemma4":
        tok = _sentencepiece_bpe(vocab, merges)
    else:
        tok = _byte_level_bpe(vocab, merges, _LLAMA3_PATTERN if family == "llama3.1" else _QWEN_PATTERN)
    _add_table(tok, [(t, ty == GGUF_CONTROL) for t, ty in zip(tokens, types) if ty in (GGUF_CONTROL, GGUF_USER_DEFINED)])
    return tok


def _from_tekken(path: Path):
    """Tekken: ids 0..999 are control tokens, then byte-level ranks; merges derived from the ranks as for any
    tiktoken-style table (each token's pair of smaller tokens, ordered by the merged token's rank)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    tekken = Tekkenizer.from_file(str(path))
    config = json.loads(path.read_text())["config"]
    n_special, size = tekken.num_special_tokens, tekken.n_words
    to_unicode = dict(enumerate(_bytes_to_unicode()))
    ranks = {}
    for entry in json.loads(path.read_text())["vocab"][: size - n_special]:
        ranks[base64.b64decode(entry["token_bytes"])] = entry["rank"]
    text = {b: "".join(to_unicode[x] for x in b) for b in ranks}
    vocab = {tekken.id_to_piece(i): i for i in range(n_special)}
    vocab.update({text[b]: n_special + r for b, r in ranks.items()})
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks and ranks[left] < rank and ranks[right] < rank:
                merges.append((rank, text[left], text[right]))
    merges = [(a, b) for _, a, b in sorted(merges)]
    tok = _byte_level_bpe(vocab, merges, config["pattern"])
    _add_table(tok, [(tekken.id_to_piece(i), True) for i in range(n_special)])
    return tok


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_family_tokenizer(family: str, vocab_dir: Path, templates: dict[str, str], cache: Path):
    """The family's tokenizer (PreTrainedTokenizerFast) with its chat template and end-of-turn eos."""
    from transformers import PreTrainedTokenizerFast

    vocab_file, template_file, eos, _ = FAMILIES[family]
    target = cache / family
    if not (target / "tokenizer.json").is_file():
        source = vocab_dir / vocab_file
        tok = _from_tekken(source) if vocab_file.endswith(".json") else _from_gguf(source, family)
        target.mkdir(parents=True, exist_ok=True)
        tok.save(str(target / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(target / "tokenizer.json"), eos_token=eos)
    fast.chat_template = templates[template_file]
    return fast


def end_of_turn_ids(family: str, tokenizer) -> tuple[int, ...]:
    _, _, eos, extra = FAMILIES[family]
    return tuple(tokenizer.convert_tokens_to_ids(t) for t in (eos, *extra))
