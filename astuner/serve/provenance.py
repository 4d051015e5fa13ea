"""Provenance spans, checked: a training datum that says where its tokens came from is held against the server's
own record of what it sampled.

The SDK lets a datum carry spans (`Datum.with_provenance`): runs that tile its input tokens and its targets, each
claiming "these positions are positions [offset, offset + length) of sequence S's prompt" (or of its sampled
tokens). The server records every sequence it samples, for the tenant that sampled it (its prompt, its tokens, the
logprobs it returned), and checks a datum's claims against that record:

    input span     tokens[p : p + n] == source[offset : offset + n]
    target span    target_tokens[p : p + n] == source[offset : offset + n], and, for sampled runs of a loss that
                   reads `logprobs`, logprobs[p : p + n] == the sampled logprobs there (exactly: both are float32)

A datum whose tokens or logprobs differ from what was sampled is refused (`astuner serve --provenance refuse`, the
default) or trained and counted (`flag`: the `provenance_mismatch:sum` metric). A span naming a sequence the server
has no record of (another tenant's, one let go from the bounded record, or one sampled before a restart) cannot be
checked: it is counted as `provenance_unverified:sum`, never refused. This is the service-side form of the
token-pipeline guard of the training loop (model_tuner/pipeline_check.py): what trains is what was sampled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from astuner.serve.futures import RequestError
from astuner.serve.tinker_losses import LOSSES
from astuner.serve.wire_proto import ForwardBackwardRequest, Span, WireDatum

log = logging.getLogger(__name__)

RECORDED_TOKENS = 4_000_000  # about 32 MB of sampled tokens and logprobs; the oldest records go first


@dataclass
class Sampled:
    tenant: str
    prompt: np.ndarray  # int32 (shared by a request's samples)
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32

    @property
    def size(self) -> int:
        return len(self.tokens) + len(self.prompt)


class SampleRecords:
    """sequence_id -> what was sampled, for its tenant; bounded by tokens held."""

    def __init__(self, max_tokens: int = RECORDED_TOKENS):
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, Sampled] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, tenant: str, sequence_id: str, prompt: np.ndarray, tokens, logprobs) -> None:
        record = Sampled(tenant, prompt, np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32))
        with self._lock:
            self._records[sequence_id] = record
            self._tokens += record.size
            while self._tokens > self.max_tokens and self._records:
                self._tokens -= self._records.popitem(last=False)[1].size

    def get(self, tenant: str, sequence_id: str) -> Sampled | None:
        with self._lock:
            record = self._records.get(sequence_id)
        return record if record is not None and record.tenant == tenant else None


@dataclass
class Verdict:
    mismatched: list[str]  # what differs, one line per datum that does
    unverified: int  # data with a span naming a sequence not on record


def verdict(records: SampleRecords, tenant: str, request: ForwardBackwardRequest, mode: str) -> dict[str, float]:
    """The request's data checked: a RequestError for a datum that differs from what was sampled (mode "refuse");
    the metrics the API reports when any datum has spans."""
    if all(d.input_spans is None and d.loss_spans is None for d in request.data):
        return {}
    kind = LOSSES.get(request.loss_fn)
    found = check(records, tenant, request.data, kind is not None and "logprobs" in kind.inputs)
    if found.mismatched:
        lines = "; ".join(found.mismatched[:3]) + ("; ..." if len(found.mismatched) > 3 else "")
        if mode == "refuse":
            raise RequestError(f"{len(found.mismatched)} datum(s) differ from what this server sampled: {lines} "
                               f"(astuner serve --provenance flag trains them and counts them instead)")
        log.warning("astuner serve: %s: %d datum(s) differ from what was sampled, trained as sent (provenance: "
                    "flag): %s", request.model_id, len(found.mismatched), lines)
    return {"provenance_mismatch:sum": float(len(found.mismatched)),
            "provenance_unverified:sum": float(found.unverified)}


def check(records: SampleRecords, tenant: str, data: list[WireDatum], reads_logprobs: bool) -> Verdict:
    mismatched, unverified = [], 0
    for index, datum in enumerate(data):
        if datum.input_spans is None and datum.loss_spans is None:
            continue
        problems, unknown = [], False
        targets = datum.inputs.get("target_tokens")
        logprobs = datum.inputs.get("logprobs") if reads_logprobs else None
        for what, spans, values in (("input token", datum.input_spans, datum.tokens),
                                    ("target", datum.loss_spans, targets)):
            if spans is None or values is None:
                continue
            if sum(s.length for s in spans) != len(values):
                problems.append(f"its {what} spans cover {sum(s.length for s in spans)} positions of {len(values)}")
                continue
            pos = 0
            for span in spans:
                found = _compare(records, tenant, span, values, pos, logprobs if what == "target" else None)
                unknown = unknown or found is None
                problems += found or []
                pos += span.length
        unverified += unknown and not problems
        if problems:
            mismatched.append(f"datum {index}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                                 if len(problems) > 1 else ""))
    return Verdict(mismatched, unverified)


def _compare(records: SampleRecords, tenant: str, span: Span, values: np.ndarray, pos: int,
             logprobs: np.ndarray | None) -> list[str] | None:
    """What differs in one span ([] for nothing), None when its sequence is not on record."""
    record = records.get(tenant, span.sequence_id)
    if record is None:
        return None
    source = record.prompt if span.source == "prompt" else record.tokens
    end = span.offset + span.length
    if end > len(source):
        return [f"positions {pos}..{pos + span.length - 1} claim {span.source} tokens {span.offset}..{end - 1} of "
                f"{span.sequence_id}, which has {len(source)}"]
    got = np.asarray(values[pos : pos + span.length]).astype(np.int64)
    differs = np.flatnonzero(got != source[span.offset : end])
    if differs.size:
        i = int(differs[0])
        return [f"position {pos + i} holds token {int(got[i])}, {span.sequence_id}'s {span.source} token "
                f"{span.offset + i} was {int(source[span.offset + i])}"]
    if logprobs is not None and span.source == "sampled":
        sent = np.asarray(logprobs[pos : pos + span.length], np.float32)
        sampled = record.logprobs[span.offset : end]
        differs = np.flatnonzero(sent != sampled)
        if differs.size:
            i = int(differs[0])
            return [f"position {pos + i} has logprob {float(sent[i])!r}, sampled as {float(sampled[i])!r} "
                    f"({span.sequence_id}, token {span.offset + i})"]
    return []
