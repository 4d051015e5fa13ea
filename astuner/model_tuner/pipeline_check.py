"""The token-pipeline preflight (`rollout.preflight: strict | warn | off`), run once before training.

A golden conversation (system, user, an assistant tool call, the tool result, a final answer; with reasoning
when a reasoning parser is in use) goes through the model's chat template and the chosen parsers:
  template      every prefix of the conversation renders;
  tool parser   the parser recovers the tool call from the template's own rendering of the assistant turn,
                tokenized and decoded as a sampled response is (a parser that does not match the model's
                format, or markers lost to skip_special_tokens, would leave reward near 0 with no error);
  extension     each turn's prompt extends the previous prompt + assistant turn (else multi-turn prompts cannot
                reuse the exact ids of earlier turns and `merge` joins nothing);
  reasoning     the reasoning parser recovers the reasoning the template wrote (with a reasoning parser);
  logprobs      engine and trainer agree on the logprobs of a short sequence sampled with the rollout's own
                temperature, top_p and top_k (max |difference|), so the check sees what training will see.
One table is printed; with `strict` any failed check stops the run (exit 2) with what to change.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from astuner.errors import UserError
from astuner.model_tuner.decoding import ResponseDecoder

log = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 0.05  # max |engine - trainer| logprob on the check sequence (fp32 CPU: ~1e-5)
# bf16 engine and trainer use different kernels, so single tokens differ by a few 0.01; a broken pipeline (wrong
# template, stale weights) differs by whole nats.
BF16_LOGPROB_TOLERANCE = 0.3

GOLDEN_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}]
GOLDEN_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
GOLDEN_REASONING = "The user asks for the weather, so I call the tool."


def golden_conversation(with_reasoning: bool) -> list[dict]:
    call = {"id": "call12345", "type": "function",  # 9 alphanumerics: the shape Mistral templates require
            "function": {"name": "get_weather", "arguments": json.dumps(GOLDEN_ARGUMENTS)}}
    tool_turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    final = {"role": "assistant", "content": "It is 18 degrees in Paris."}
    if with_reasoning:
        tool_turn["reasoning_content"] = GOLDEN_REASONING
        final["reasoning_content"] = "The tool answered."
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        tool_turn,
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "18 degrees, sunny"},
        final,
    ]


@dataclass
class CheckRow:
    name: str
    ok: bool
    detail: str


def assistant_turn_text(renderer, messages: list[dict], index: int, tools, stop_texts: tuple[str, ...]) -> str:
    """What the template writes for assistant turn `messages[index]`, up to its end-of-turn marker: the text a
    model of this family generates for that turn. Found where the rendering diverges from the same conversation
    ending in a sentinel answer, so it works for templates that move earlier text (Mistral's system prompt)."""
    upto = renderer.render_text(messages[: index + 1], tools, add_generation_prompt=False)
    sentinel = renderer.render_text(messages[:index] + [{"role": "assistant", "content": _SENTINEL}], tools,
                                    add_generation_prompt=False)
    common = 0
    for x, y in zip(upto, sentinel):
        if x != y:
            break
        common += 1
    turn = upto[common:]
    ends = [turn.find(t) for t in stop_texts if t and t in turn]
    return turn[: min(ends)] if ends else turn


_SENTINEL = "ZQXJ sentinel answer"


def check_pipeline(renderer, chat_format, tool_parser, reasoning_parser, stop_texts: tuple[str, ...],
                   logprob_check: Callable[[], tuple[float, int]] | None = None) -> list[CheckRow]:
    with_reasoning = chat_format.reasoning_parser != "none"
    messages = golden_conversation(with_reasoning)
    tools = GOLDEN_TOOLS
    rows: list[CheckRow] = []

    try:
        for n in range(2, len(messages) + 1):  # from the first user message (Llama puts tools in it)
            renderer.render_text(messages[:n], tools, add_generation_prompt=messages[n - 1]["role"] != "assistant")
        rows.append(CheckRow("template", True, f"{len(messages)} messages render with tools"))
    except Exception as exc:  # noqa: BLE001 - a template error is the finding
        rows.append(CheckRow("template", False, f"the chat template raised {type(exc).__name__}: {exc}"))
        return rows

    try:
        text = assistant_turn_text(renderer, messages, 2, tools, stop_texts)
        # The way a sampled response reaches the parser: as ids, decoded with the format's markers kept.
        decoder = ResponseDecoder(renderer.tokenizer, (*tool_parser.markers, *reasoning_parser.markers))
        text = decoder.decode(renderer.tokenizer.encode(text, add_special_tokens=False))
        split = reasoning_parser.split(text)
        parsed = tool_parser.parse(split.content, {"get_weather"})
        got = [(c.name, c.arguments) for c in parsed.tool_calls]
        ok = got == [("get_weather", GOLDEN_ARGUMENTS)] and not parsed.errors
        detail = (f"{chat_format.tool_parser} reads the template's call" if ok else
                  f"{chat_format.tool_parser} read {got or 'no call'} {parsed.errors or ''} from {text[:80]!r}")
        rows.append(CheckRow("tool parser", ok, detail))
        if with_reasoning:
            ok = (split.reasoning or "").strip() == GOLDEN_REASONING
            rows.append(CheckRow("reasoning", ok, f"{chat_format.reasoning_parser} parser splits the template's "
                                 "reasoning" if ok else
                                 f"reasoning read as {split.reasoning!r}"))
    except Exception as exc:  # noqa: BLE001
        rows.append(CheckRow("tool parser", False, f"{type(exc).__name__}: {exc}"))

    bad = []
    for index in (2, 4):
        a = renderer.render_text(messages[:index], tools)
        b = renderer.render_text(messages[: index + 1], tools, add_generation_prompt=False)
        nxt = renderer.render_text(messages[: index + 2], tools) if index + 2 <= len(messages) else b
        if not (b.startswith(a) and nxt.startswith(b)):
            bad.append(index)
    rows.append(CheckRow("extension", not bad, "each prompt extends the previous turns" if not bad else
                         f"the template rewrites earlier turns after message {bad}: multi-turn prompts are "
                         "re-rendered and merge cannot join those calls"))

    if logprob_check is not None:
        diff, n = logprob_check()
        tol = getattr(logprob_check, "tolerance", LOGPROB_TOLERANCE)
        sampling = getattr(logprob_check, "sampling", None)
        how = f"; sampled with {sampling.describe()}" if sampling is not None else ""
        rows.append(CheckRow("logprobs", diff <= tol,
                             f"engine vs trainer max |diff| {diff:.2e} over {n} tokens (tolerance {tol}{how})"))
    return rows


def _advice(fatal: list[CheckRow]) -> str:
    """What to change, for the checks that failed: a parser advice only when a parser check failed."""
    names = {r.name for r in fatal}
    parts = []
    if names - {"logprobs"}:
        parts.append(
            "The chat template or the parsers do not match the model, so training would run on calls the agent "
            "cannot use. Set astuner.rollout.tool_call_parser (hermes | qwen3_coder | llama3_json | mistral) and "
            "astuner.rollout.reasoning_parser to the model's format.")
    if "logprobs" in names:
        parts.append(
            "The engine and the trainer give different logprobs for the same tokens, so the policy-gradient ratio "
            "would be wrong from the first step. They load the same weights from astuner.model.path; check that "
            "the engine and the trainer use the same dtype (trainer_common.precision), and that the engine applies "
            "the same temperature, top_p and top_k as the trainer (an 'inf' means a sampled token lies outside the "
            "trainer's top_p/top_k filter).")
    parts.append("Set astuner.rollout.preflight: warn to train anyway.")
    return " ".join(parts)


def format_table(rows: list[CheckRow], chat_format, seconds: float) -> str:
    lines = [f"token pipeline ({chat_format.family}; tool parser {chat_format.tool_parser} [{chat_format.how}], "
             f"reasoning parser {chat_format.reasoning_parser}; {seconds:.2f}s):"]
    width = max(len(r.name) for r in rows)
    for r in rows:
        lines.append(f"  {r.name:<{width}}  {'ok  ' if r.ok else 'FAIL'}  {r.detail}")
    return "\n".join(lines)


def check_runner(mode: str, runner, logprob_check=None) -> list[CheckRow]:
    """`run_preflight` over a rollout runner's renderer, parsers and turn ends (`mode`: astuner.rollout.preflight)."""
    return run_preflight(mode, runner.renderer, runner.chat_format, runner.parser, runner.reasoning_parser,
                         runner.stop_texts(), logprob_check)


def run_preflight(mode: str, renderer, chat_format, tool_parser, reasoning_parser, stop_texts,
                  logprob_check=None) -> list[CheckRow]:
    if mode == "off":
        return []
    start = time.perf_counter()
    rows = check_pipeline(renderer, chat_format, tool_parser, reasoning_parser, stop_texts, logprob_check)
    table = format_table(rows, chat_format, time.perf_counter() - start)
    failed = [r for r in rows if not r.ok]
    # The extension check only costs efficiency (prompts are re-rendered, never wrong), so it never stops a run.
    fatal = [r for r in failed if r.name != "extension"]
    if fatal and mode == "strict":
        raise UserError(f"{table}\n{_advice(fatal)}")
    if failed:
        log.warning("%s", table)
    else:
        from astuner.logs import announce

        announce(table)  # on the console too: the user sees which parsers were chosen
    return rows


@dataclass(frozen=True)
class CheckSampling:
    """The rollout's sampling settings, which the logprob check samples and scores with."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, spec) -> "CheckSampling":
        """A model's training-rollout sampling (its `config.model_set.ModelSpec`)."""
        return cls(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)

    def describe(self) -> str:
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}"


def sample_check_answer(engine, prompt_ids: list[int], stop_token_ids, sampling: CheckSampling = CheckSampling(),
                        n_tokens: int = 16):
    """(token ids, logprobs) of a short answer the engine samples after `prompt_ids` with the rollout's sampling."""
    import asyncio

    from astuner.types import SamplingParams

    sampling = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_tokens=n_tokens, stop_token_ids=tuple(stop_token_ids), seed=0)
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(engine.generate(prompt_ids, sampling, request_id="preflight"))
    finally:
        loop.close()
    return list(result.token_ids), list(result.logprobs)


def logprob_check(renderer, sample, score, precision: str, sampling: CheckSampling = CheckSampling()):
    """A callable for `check_pipeline`: `sample(prompt ids)` -> (answer ids, engine logprobs) and
    `score(prompt ids, answer ids, temperature)` -> the trainer's logprobs; wherever engine and trainer live.
    Both sides use the rollout's `sampling` (the trainer applies the same top_p/top_k filter)."""

    def check() -> tuple[float, int]:
        prompt = renderer.render([{"role": "user", "content": "Count from one to ten."}])
        ids, engine_logprobs = sample(prompt)
        if not ids:
            return 0.0, 0
        mine = score(prompt, ids, sampling.temperature)
        return max(abs(a - b) for a, b in zip(mine, engine_logprobs)), len(mine)

    check.tolerance = BF16_LOGPROB_TOLERANCE if precision == "bf16" else LOGPROB_TOLERANCE
    check.sampling = sampling
    return check


def engine_trainer_logprob_check(engine, trainer, renderer, stop_token_ids, sampling: CheckSampling = CheckSampling()):
    """`logprob_check` for an engine and a trainer in this process."""
    return logprob_check(renderer, lambda prompt: sample_check_answer(engine, prompt, stop_token_ids, sampling),
                         lambda prompt, ids, temperature: trainer.compute_logprobs(prompt, ids, temperature),
                         getattr(trainer, "precision", "fp32"), sampling)
