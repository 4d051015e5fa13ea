"""The few protobuf messages of the Tinker API, read and written by hand (no generated code, no protobuf package).

The Tinker SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and reads `forward` /
`forward_backward` and `sample` results only as protobuf (`ForwardBackwardOutput`, `SampleResponse`). These are
small proto3 messages; the wire format needs four things: varints, 64-bit doubles, length-delimited fields and
maps (repeated {1: key, 2: value} messages). Packed numbers are little-endian byte strings in these messages
(token ids int32, floats float32, offsets int64), read with numpy.

Field numbers, as the API's schema gives them:
    ForwardBackwardRequest  1 model_id  2 seq_id  3 data (Datum)*  4 loss_fn  5 loss_fn_config <str, double>
                            6 forward_only  7 loss_fn_config_v2 <str, LossConfigValue {1 number | 2 text}>
    Datum                   1 model_input (Chunk)*  2 loss_fn_inputs <str, Tensor>  3 model_input_spans (Span)*
                            4 loss_fn_input_spans (Span)*
    Span                    1 prompt_tokens | 2 sampled_tokens, each {1 sequence_id  2 offset  3 length}
    Chunk                   1 encoded_text {1 tokens: int32 LE}  2 image  3 dmel
    Tensor                  1 dense  2 sparse_csr {1 values  2 crow_indices  3 col_indices}  3 dtype  4 shape*
    ForwardBackwardOutput   1 loss_fn_output_type  2 loss_fn_outputs (ArrayRecord)*  3 metrics <str, double>
    ArrayRecord             1 type_tag  2 fields <str, BatchedTensor>  3 num_datums
    BatchedTensor           1 data  2 offsets (int64 LE byte offsets, num_datums + 1)  3 dtype  4 trailing_shape*
    SampleResponse          1 sequences (SampledSequence)*  2 prompt_logprobs (float32 LE, NaN where none)
                            3 topk_prompt_logprobs (TopkLogprobs)
    TopkLogprobs            1 token_ids (int32 LE, length x k)  2 logprobs (float32 LE)  3 k  4 length
    SampledSequence         1 stop_reason (0 stop, 1 length)  2 tokens (int32 LE)  3 logprobs (float32 LE)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
NUMPY_DTYPES = {DTYPE_FLOAT32: "<f4", DTYPE_INT64: "<i8", DTYPE_INT32: "<i4"}
STOP_REASONS = {"stop": 0, "length": 1}


class ProtoError(ValueError):
    """A body that is not the message it should be (the request is refused with a 400)."""


# --- wire format -------------------------------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 64 bits")


def fields(buf: bytes) -> dict[int, list]:
    """A message's fields by number, each a list of raw values in order: ints (varint), bytes (length-delimited)
    or 8-/4-byte strings (fixed64 / fixed32)."""
    out: dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ProtoError(f"unsupported wire type {wire} (field {number})")
        if pos > len(buf):
            raise ProtoError("truncated field")
        out.setdefault(number, []).append(value)
    return out


def _last(f: dict[int, list], number: int, default=None):
    """The field's last value (proto3: the last one wins), checked to be of the default's kind."""
    if number not in f:
        return default
    value = f[number][-1]
    kind = bytes if isinstance(default, bytes) else int if isinstance(default, int) else None
    if kind is not None and not isinstance(value, kind):
        raise ProtoError(f"field {number} has the wrong wire type")
    return value


def _messages(f: dict[int, list], number: int) -> list[bytes]:
    """A repeated message field's values (each length-delimited)."""
    values = f.get(number, [])
    if any(not isinstance(v, bytes) for v in values):
        raise ProtoError(f"field {number} has the wrong wire type")
    return values


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError("a string field is not UTF-8") from None


def _packed_ints(values: list) -> list[int]:
    """A repeated integer field, packed (one bytes value) or not (several ints)."""
    out: list[int] = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        pos = 0
        while pos < len(v):
            x, pos = _varint(v, pos)
            out.append(x)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in out]


def _map(values: list[bytes], value_default=b"") -> list[tuple[bytes, object]]:
    return [(_last(entry, 1, b""), _last(entry, 2, value_default)) for entry in map(fields, values)]


def _key(number: int, wire: int) -> bytes:
    return _enc_varint(number << 3 | wire)


def _enc_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _key(number, 2) + _enc_varint(len(data)) + data


def _int_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _enc_varint(value) if value else b""


def _double_field(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


# --- ForwardBackwardRequest ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """A run of a datum's positions that claims to come from a sampled sequence: its prompt or its tokens."""

    source: str  # "prompt" or "sampled"
    sequence_id: str
    offset: int
    length: int


@dataclass
class WireDatum:
    tokens: np.ndarray  # int32, the model_input's text tokens
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, dense
    input_spans: list[Span] | None = None  # provenance: tiling tokens
    loss_spans: list[Span] | None = None  # provenance: tiling loss_fn_inputs["target_tokens"]


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[WireDatum]
    config: dict[str, float | str] = field(default_factory=dict)


def _array(raw: bytes, dtype: str) -> np.ndarray:
    if len(raw) % np.dtype(dtype).itemsize:
        raise ProtoError(f"{len(raw)} bytes are not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype)


def _tensor(raw: bytes, name: str) -> np.ndarray:
    f = fields(raw)
    dtype = NUMPY_DTYPES.get(_last(f, 3, 0))
    if dtype is None:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: dtype {_last(f, 3, 0)} (float32, int64 or int32 only)")
    shape = _packed_ints(f.get(4, []))
    if any(x < 0 for x in shape) or int(np.prod(shape, dtype=np.float64)) > 1 << 31:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: shape {shape}")
    if 2 in f:  # CSR: implicit entries are 0
        csr = fields(_last(f, 2, b""))
        values = _array(_last(csr, 1, b""), dtype)
        crow, col = _array(_last(csr, 2, b""), "<i8"), _array(_last(csr, 3, b""), "<i8")
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or \
                np.any(np.diff(crow) < 0) or crow[0] != 0 or crow[-1] != len(values) or \
                np.any((col < 0) | (col >= shape[1])):
            raise ProtoError(f"loss_fn_inputs[{name!r}]: malformed sparse tensor")
        dense = np.zeros(shape, dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense
    data = _array(_last(f, 1, b""), dtype)
    if int(np.prod(shape)) != data.size:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {data.size} values")
    return data.reshape(shape)


def _span(raw: bytes) -> Span:
    f = fields(raw)
    source = "sampled" if 2 in f else "prompt" if 1 in f else None
    if source is None:
        raise ProtoError("a provenance span names neither prompt nor sampled tokens")
    arm = fields(_last(f, 2 if source == "sampled" else 1, b""))
    offset, length = _last(arm, 2, 0), _last(arm, 3, 0)
    if not 0 <= offset < 1 << 31 or not 0 <= length < 1 << 31:
        raise ProtoError(f"a provenance span has offset {offset}, length {length}")
    return Span(source, _text(_last(arm, 1, b"")), offset, length)


def _datum(raw: bytes, index: int) -> WireDatum:
    f = fields(raw)
    chunks: list[np.ndarray] = []
    for chunk in map(fields, _messages(f, 1)):
        if 1 not in chunk:
            kind = "an image" if 2 in chunk else "a dmel" if 3 in chunk else "an unknown"
            raise ProtoError(f"datum {index}: {kind} chunk; astuner serve trains on text tokens only")
        chunks.append(_array(_last(fields(_last(chunk, 1, b"")), 1, b""), "<i4"))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, "<i4")
    inputs = {_text(k): _tensor(v, _text(k)) for k, v in _map(_messages(f, 2))}
    spans = [[_span(raw) for raw in _messages(f, number)] if number in f else None for number in (3, 4)]
    return WireDatum(tokens, inputs, *spans)


def peek_sequence(body: bytes) -> tuple[str, int] | None:
    """A ForwardBackwardRequest's model_id and seq_id, read without parsing its data (None if unreadable)."""
    pos, model_id, seq = 0, None, None
    try:
        while pos < len(body) and (model_id is None or seq is None):
            key, pos = _varint(body, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(body, pos)
                seq = value if number == 2 else seq
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                size, pos = _varint(body, pos)
                if number == 1:
                    model_id = body[pos : pos + size].decode("utf-8")
                pos += size
            else:
                return None
    except (ProtoError, UnicodeDecodeError):
        return None
    return (model_id, seq - (1 << 64) if seq >= 1 << 63 else seq) if model_id and seq is not None else None


def _double(raw) -> float:
    if not isinstance(raw, bytes) or len(raw) != 8:
        raise ProtoError("a double field has the wrong wire type")
    return struct.unpack("<d", raw)[0]


def _config_value(raw: bytes):
    f = fields(raw)
    if 1 in f:
        return _double(f[1][-1])
    return _text(_last(f, 2, b""))


def read_forward_backward(body: bytes) -> ForwardBackwardRequest:
    f = fields(body)
    config: dict[str, float | str] = {_text(k): _double(v) for k, v in _map(_messages(f, 5), None)
                                      if v is not None}
    config.update({_text(k): _config_value(v) for k, v in _map(_messages(f, 7))})
    seq = _last(f, 2, 0)
    return ForwardBackwardRequest(
        model_id=_text(_last(f, 1, b"")), seq_id=seq - (1 << 64) if seq >= 1 << 63 else seq,
        loss_fn=_text(_last(f, 4, b"")), forward_only=bool(_last(f, 6, 0)),
        data=[_datum(raw, i) for i, raw in enumerate(_messages(f, 3))], config=config)


# --- results -------------------------------------------------------------------------------------------------------

def forward_backward_output(outputs: dict[str, list[np.ndarray]], num_datums: int, metrics: dict[str, float]) -> bytes:
    """One ArrayRecord holding, per output name, every datum's float32 1-D array."""
    record = _int_field(3, num_datums) + _bytes_field(1, b"ArrayRecord")
    for name, arrays in outputs.items():
        parts = [np.ascontiguousarray(a, "<f4").tobytes() for a in arrays]
        offsets = np.cumsum([0] + [len(p) for p in parts]).astype("<i8").tobytes()
        batched = _bytes_field(1, b"".join(parts)) + _bytes_field(2, offsets) + _int_field(3, DTYPE_FLOAT32)
        record += _bytes_field(2, _bytes_field(1, name.encode()) + _bytes_field(2, batched))
    out = _bytes_field(1, b"ArrayRecord") + _bytes_field(2, record)
    for name, value in metrics.items():
        out += _bytes_field(3, _bytes_field(1, name.encode()) + _double_field(2, float(value)))
    return out


TOPK_SENTINEL = (0, -99999.0)  # the API's filler where a position has fewer than k (or no) entries


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: list[float] | None = None, topk: list | None = None, k: int = 0) -> bytes:
    """sequences: (tokens, logprobs, "stop" | "length"); prompt_logprobs: NaN where none (the first token);
    topk: per prompt position a list of (token id, logprob), or None where none."""
    out = b""
    for tokens, logprobs, reason in sequences:
        seq = _int_field(1, STOP_REASONS[reason]) + _bytes_field(2, np.asarray(tokens, "<i4").tobytes())
        seq += _bytes_field(3, np.asarray(logprobs, "<f4").tobytes())
        out += _bytes_field(1, seq)
    if prompt_logprobs is not None:
        out += _bytes_field(2, np.asarray(prompt_logprobs, "<f4").tobytes())
    if topk is not None and k > 0:
        rows = [(list(pos or []) + [TOPK_SENTINEL] * k)[:k] for pos in topk]
        ids = np.asarray([[t for t, _ in row] for row in rows], "<i4").reshape(len(rows), k)
        lps = np.asarray([[lp for _, lp in row] for row in rows], "<f4").reshape(len(rows), k)
        out += _bytes_field(3, _bytes_field(1, ids.tobytes()) + _bytes_field(2, lps.tobytes()) + _int_field(3, k)
                            + _int_field(4, len(rows)))
    return out
