"""Teachers: what scores the student's tokens for on-policy distillation (astuner/algorithm/distillation.py).

A teacher has one method, `score(sequences, topk=0) -> [PromptLogprobs | exception]`: for each token-id sequence x,
values[i] = log p_T(x_{i+1} | x_<=i) (len(x) - 1 of them) and, with topk = k, the teacher's k likeliest tokens at
each of those positions (`topk[i]`: (token id, logprob), likeliest first); or the exception that stopped it (a
failure of one sequence or request never takes down the others' results).

    EngineTeacher     a model folder in this process, on an inference engine (`InferenceEngine.prompt_logprobs`)
    EndpointTeacher   an OpenAI-compatible server: POST /completions with the ids as the prompt, echo, logprobs k,
                      one generated token (ignored); `choices[k].logprobs.token_logprobs` = [null, logprobs...] and
                      `top_logprobs` = [null, {"token_id:N": logprob}...] (vLLM's form; prompt logprobs are the raw
                      model's, before any temperature)
    TinkerTeacher     a Tinker API server (`astuner serve`, or Tinker itself) through the `tinker` SDK: a sampler's
                      `compute_logprobs` ([None, logprobs...]), or with top-k its `sample` with
                      `topk_prompt_logprobs`; one future per sequence

Each is checked at start to read the student's tokens (a server by its `check_tokens`: an OpenAI server by
`check_vocabulary`, a Tinker server's tokenizer and a model folder's by `check_teacher_tokens`): a run whose
teacher splits text differently would distil noise. `TEACHER_APIS` picks a server's class by astuner.teacher.api.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from astuner.errors import UserError
from astuner.types import PromptLogprobs

log = logging.getLogger(__name__)


class EngineTeacher:
    """A model in this process; sequences scored one forward each, in sorted order so that those which begin alike
    (a task's repeats) follow one another and an engine that keeps the last one's cache forwards only where they
    part (the HF engine's `prompt_logprobs`, vLLM's prefix cache); `timeout_s` a deadline for the whole call."""

    def __init__(self, engine, timeout_s: float, name: str) -> None:
        self.engine, self.timeout_s, self.name = engine, timeout_s, name

    def score(self, sequences: list[list[int]], topk: int = 0) -> list[PromptLogprobs | BaseException]:
        deadline = time.monotonic() + self.timeout_s
        out: list[PromptLogprobs | BaseException | None] = [None] * len(sequences)
        for i in sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i)):
            seq = sequences[i]
            if time.monotonic() > deadline:
                out[i] = TimeoutError(f"the teacher {self.name} did not score {len(sequences)} sequences within "
                                      f"astuner.teacher.timeout_s = {self.timeout_s:g} s")
                continue
            try:
                out[i] = checked(self.engine.prompt_logprobs(list(seq), topk=topk), seq, topk, self.name)
            except Exception as exc:  # noqa: BLE001 - one sequence's failure flags its episode only
                out[i] = exc
        return out  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.engine.shutdown()


class EndpointTeacher:
    """An OpenAI-compatible completions server that echoes prompt logprobs (module docstring)."""

    def __init__(self, base_url: str, model: str | None, api_key_env: str, timeout_s: float, batch_size: int,
                 client=None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        key = os.environ.get(api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = client or httpx.Client(headers=headers, timeout=timeout_s)
        self.timeout_s, self.batch_size = timeout_s, batch_size
        self.model = model or self._first_model()
        self.name = f"{self.model} at {self.base_url}"

    @classmethod
    def from_section(cls, t) -> "EndpointTeacher":
        """The server of astuner.teacher (`t`): base_url, served_model, api_key_env, timeout_s, batch_size."""
        return cls(t.base_url, t.served_model, t.api_key_env, t.timeout_s, t.batch_size)

    def check_tokens(self, tokenizer, student: str) -> None:
        """UserError (exit 2) unless the server tokenizes as the student does (`check_vocabulary`)."""
        check_vocabulary(self, tokenizer, student)

    def _first_model(self) -> str:
        try:
            response = self.client.get(f"{self.base_url}/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except Exception as exc:  # noqa: BLE001 - any failure here is the user's server or URL
            raise UserError(f"astuner.teacher.base_url: could not list the models of {self.base_url}/models ({exc}). "
                            "Start the teacher's server (e.g. `vllm serve PATH`), check the URL (it ends in /v1), "
                            "or name the model in astuner.teacher.served_model") from None

    def _post(self, prompt, topk: int = 0) -> list[dict]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": topk,
                "temperature": 1.0, "return_tokens_as_token_ids": True}
        response = self.client.post(f"{self.base_url}/completions", json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"the teacher {self.name} answered {response.status_code}: {response.text[:300]}")
        choices = sorted(response.json()["choices"], key=lambda c: c.get("index", 0))
        return [c["logprobs"] for c in choices]

    def score(self, sequences: list[list[int]], topk: int = 0) -> list[PromptLogprobs | BaseException]:
        batches = [sequences[i : i + self.batch_size] for i in range(0, len(sequences), self.batch_size)]
        with ThreadPoolExecutor(max_workers=min(4, max(1, len(batches)))) as pool:
            results = list(pool.map(lambda batch: self._score_batch(batch, topk), batches))
        return [r for batch in results for r in batch]

    def _score_batch(self, batch: list[list[int]], topk: int) -> list[PromptLogprobs | BaseException]:
        try:
            answers = self._post([list(seq) for seq in batch], topk)
            if len(answers) != len(batch):
                raise RuntimeError(f"the teacher {self.name} returned {len(answers)} choices for {len(batch)} prompts")
        except Exception as exc:  # noqa: BLE001 - the request failed: every sequence of it is flagged
            return [exc] * len(batch)
        out: list[PromptLogprobs | BaseException] = []
        for seq, logprobs in zip(batch, answers):
            # [null, x_1 .. x_{n-1}, the generated token]: the prompt's are 1 .. n-1.
            values = ((logprobs or {}).get("token_logprobs") or [])[1 : len(seq)]
            top = ((logprobs or {}).get("top_logprobs") or [])[1 : len(seq)] if topk else None
            try:
                if len(values) != len(seq) - 1 or any(v is None for v in values):
                    raise RuntimeError(f"the teacher {self.name} echoed {len(values)} prompt logprobs for "
                                       f"{len(seq)} tokens (does it support echo with logprobs?)")
                ranked = None if top is None else [ranked_ids(position, topk, self.name) for position in top]
                out.append(checked(PromptLogprobs([float(v) for v in values], ranked), seq, topk, self.name))
            except Exception as exc:  # noqa: BLE001 - this sequence's answer is unusable: its episode is flagged
                out.append(exc)
        return out

    def server_ids(self, text: str) -> list[int] | list[str]:
        """How the server tokenizes `text`: token ids where it names them ("token_id:N"), else token strings."""
        tokens = (self._post(text)[0] or {}).get("tokens") or []
        tokens = tokens[:-1]  # the generated token
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            return [int(t.split(":", 1)[1]) for t in tokens]
        return list(tokens)

    def shutdown(self) -> None:
        self.client.close()


class TinkerTeacher:
    """A sampler of a Tinker API server (module docstring); `model`: a tinker:// path of saved sampler weights, or
    a base model's name."""

    def __init__(self, base_url: str, model: str, api_key_env: str, timeout_s: float) -> None:
        try:
            import tinker
        except ImportError:
            raise UserError("astuner.teacher.api: tinker needs the tinker SDK: pip install tinker") from None
        key = os.environ.get(api_key_env) or "tml-local"
        self.timeout_s, self.name = timeout_s, f"{model} at {base_url}"
        try:
            self.service = tinker.ServiceClient(base_url=base_url, api_key=key)
            kind = "model_path" if model.startswith("tinker://") else "base_model"
            self.sampler = self.service.create_sampling_client(**{kind: model}).result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure here is the user's server, key or model name
            raise UserError(f"astuner.teacher: could not open a sampler of {self.name} ({type(exc).__name__}: {exc}). "
                            "Start the server (e.g. `astuner serve`), check the URL and key, and name a tinker:// "
                            "path or a base model in astuner.teacher.served_model") from None

    @classmethod
    def from_section(cls, t) -> "TinkerTeacher":
        """The sampler of astuner.teacher (`t`): base_url, served_model, api_key_env, timeout_s."""
        return cls(t.base_url, t.served_model, t.api_key_env, t.timeout_s)

    def check_tokens(self, tokenizer, student: str) -> None:
        """UserError (exit 2) unless the server's tokenizer has the student's vocabulary."""
        try:
            theirs = self.tokenizer()
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"astuner.teacher: could not load the tokenizer of {self.name} to check that it "
                            f"reads the student's tokens ({type(exc).__name__}: {exc})") from None
        check_teacher_tokens(tokenizer, self.name, "astuner.teacher.served_model", student, theirs)

    def score(self, sequences: list[list[int]], topk: int = 0) -> list[PromptLogprobs | BaseException]:
        from tinker import types

        deadline = time.monotonic() + self.timeout_s
        inputs = [types.ModelInput.from_ints(list(seq)) for seq in sequences]
        if topk:  # prompt logprobs with the top-k come with a one-token sample (the token is ignored)
            params = types.SamplingParams(max_tokens=1, temperature=1.0)
            futures = [self.sampler.sample(x, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=topk)
                       for x in inputs]
        else:
            futures = [self.sampler.compute_logprobs(x) for x in inputs]
        out: list[PromptLogprobs | BaseException] = []
        for seq, future in zip(sequences, futures):
            try:
                answer = future.result(timeout=max(0.0, deadline - time.monotonic()))
                values = (answer.prompt_logprobs if topk else answer)[1:]
                if len(values) != len(seq) - 1 or any(v is None for v in values):
                    raise RuntimeError(f"the teacher {self.name} returned {len(values)} prompt logprobs for "
                                       f"{len(seq)} tokens")
                top = [list(p or []) for p in (answer.topk_prompt_logprobs or [])[1:]] if topk else None
                out.append(checked(PromptLogprobs([float(v) for v in values], top), seq, topk, self.name))
            except Exception as exc:  # noqa: BLE001 - one sequence's failure flags its episode only
                out.append(exc)
        return out

    def tokenizer(self):
        return self.sampler.get_tokenizer()

    def shutdown(self) -> None:
        try:  # ends the SDK's session on the server (a failure here loses nothing: the run is over)
            self.service.close("success").result(timeout=10)
        except Exception as exc:  # noqa: BLE001
            log.debug("closing the teacher's Tinker session: %s", exc)


def ranked_ids(position: dict | None, topk: int, name: str) -> list[tuple[int, float]]:
    """An OpenAI `top_logprobs` entry ({"token_id:N": logprob}) as the k likeliest (id, logprob), likeliest first."""
    pairs = []
    for key, value in (position or {}).items():
        if not (isinstance(key, str) and key.startswith("token_id:")):
            raise RuntimeError(f"the teacher {name} names its top tokens as text ({key!r}), not ids: serve it with "
                               "return_tokens_as_token_ids (vLLM does, as asked)")
        pairs.append((int(key.split(":", 1)[1]), float(value)))
    return sorted(pairs, key=lambda p: -p[1])[:topk]


def checked(scored: PromptLogprobs, seq: list[int], topk: int, name: str) -> PromptLogprobs:
    """`scored` when it has a logprob for each of seq's tokens after the first, and with top-k, k ids at each
    position; else the RuntimeError that flags its episode."""
    if len(scored.values) != len(seq) - 1:
        raise RuntimeError(f"the teacher {name} returned {len(scored.values)} logprobs for {len(seq)} tokens")
    if topk:
        top = scored.topk or []
        if len(top) != len(seq) - 1 or any(len(p) < min(topk, 1) for p in top):
            raise RuntimeError(f"the teacher {name} returned its top-{topk} tokens at {len(top)} of "
                               f"{len(seq) - 1} positions")
        scored = PromptLogprobs(list(scored.values), [[(int(t), float(lp)) for t, lp in p[:topk]] for p in top])
    return scored


# astuner.teacher.api -> the class of a teacher server (astuner.teacher.base_url)
TEACHER_APIS = {"openai": EndpointTeacher, "tinker": TinkerTeacher}


def check_teacher_tokens(tokenizer, path: str, key: str, student: str, other=None) -> None:
    """A teacher scores the student's token ids: its vocabulary (the tokenizer at `path`, or `other`) must be the
    student's, its chat template need not."""
    from astuner.tokenizer import check_same_tokenizer

    check_same_tokenizer(tokenizer, path, key, other=other, template=False, whose=f"the student {student}",
                         remedy="On-policy distillation scores the student's exact token ids: pick a teacher of the "
                                "student's family")


PROBE = [{"role": "system", "content": "You check tools."},
         {"role": "user", "content": "What is 12 x 7? Reply in JSON: {\"answer\": 84}."},
         {"role": "assistant", "content": "<tool_call>\n{\"name\": \"calc\"}\n</tool_call> 84 ünïcödé 🙂"}]


def check_vocabulary(teacher: EndpointTeacher, tokenizer, student: str) -> None:
    """UserError (exit 2) unless the server tokenizes a rendered chat as the student's tokenizer does."""
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain text still tells
        text = " ".join(m["content"] for m in PROBE)
    ours = tokenizer.encode(text, add_special_tokens=False)
    try:
        theirs = teacher.server_ids(text)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"astuner.teacher.base_url: the teacher {teacher.name} could not score a probe ({exc}); "
                        "check that it serves /v1/completions with echo and logprobs (vLLM does)") from None
    if theirs and isinstance(theirs[0], str):
        ours_cmp: list = [tokenizer.decode([i]) for i in ours]
    else:
        ours_cmp = ours
    if theirs == ours_cmp or theirs[1:] == ours_cmp:  # the server may put a BOS token first
        return
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours_cmp)) if a != b), min(len(theirs), len(ours_cmp)))
    raise UserError(
        f"astuner.teacher: the teacher {teacher.name} does not read the student's tokens: a probe chat is "
        f"{len(theirs)} tokens to its tokenizer and {len(ours_cmp)} to the student's ({student}), first differing at "
        f"token {first} ({theirs[first:first + 3]!r} against {ours_cmp[first:first + 3]!r}). On-policy distillation "
        "scores the student's exact token ids: serve a teacher of the student's family (same vocabulary)")
