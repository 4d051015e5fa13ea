"""Hostile requests to both endpoints: a table of malformed bodies, unknown routes and wrong methods for the OpenAI
and the Anthropic API, then `hypothesis` bodies built from each API's own fields. A refusal is a 4xx in the API's
own error shape, with `x-should-retry: false` (the SDKs would retry it otherwise), and records no call; nothing is
ever a 500 (the ASGI transport raises any exception the app lets through)."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_vocab import FAMILIES
from test_model_tuner import make_tuner
from test_responses_api import MALFORMED as RESPONSES_MALFORMED

from astuner.model_tuner.frontends.gateway import Gateway
from astuner.model_tuner.tuner import TunerLimits
from astuner.types import GenerateResult

QUESTION = [{"role": "user", "content": "What is 6*12?"}]
PY_TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
CLAUDE_TOOL = {"name": "run", "description": "Run code.", "input_schema": {"type": "object"}}
ANTHROPIC_ERRORS = {"invalid_request_error", "authentication_error", "not_found_error", "timeout_error"}


class SteadyEngine:
    """Answers every call with the same short text (a fuzzed run makes hundreds of calls)."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode("It is 72.", add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, sampling, request_id=None):
        ids = self.ids[: sampling.max_tokens]
        return GenerateResult(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop")

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def served(demo_tokenizer):
    """(gateway, tuner) with limits no fuzzed call reaches, so a refusal is always the request's own fault."""
    gateway = Gateway()
    limits = TunerLimits(max_model_len=1 << 20, max_tokens_per_turn=16, max_response_tokens=1 << 30,
                         max_prompt_length=1 << 20)
    tuner, _ = make_tuner(demo_tokenizer, [], limits=limits, gateway=gateway)
    tuner.engine = SteadyEngine(demo_tokenizer)
    yield gateway, tuner
    gateway.close()


def send(served, method: str, path: str, body=None, key: str | None = "episode") -> httpx.Response:
    gateway, tuner = served
    key = tuner.api_key if key == "episode" else key
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-api-key" if path.startswith("/v1/messages") else "authorization"] = (
            key if path.startswith("/v1/messages") else f"Bearer {key}")
    content = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://t") as http:
            return await http.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def assert_refused(response: httpx.Response, anthropic_shape: bool) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert response.headers.get("x-should-retry") == "false"
    body = response.json()
    if anthropic_shape:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] in ANTHROPIC_ERRORS and body["error"]["message"]
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def chat(**fields) -> dict:
    return {"model": "p", "messages": QUESTION, **fields}


def claude(**fields) -> dict:
    return {"model": "p", "max_tokens": 16, "messages": QUESTION, **fields}


def user(content) -> dict:
    return {"model": "p", "max_tokens": 16, "messages": [{"role": "user", "content": content}]}


def _called(arguments="{}", call_id="abcdefghi") -> dict:
    call = {"type": "function", "function": {"name": "run", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call if call_id is None else {**call, "id": call_id}]}


def _result(call_id="abcdefghi") -> dict:  # nine alphanumerics: the id Mistral's template takes
    return {"role": "tool", "content": "72", **({} if call_id is None else {"tool_call_id": call_id})}


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "run", "parameters": parameters}}


def _used(**block) -> list[dict]:
    """A conversation whose assistant turn holds one tool_use block (`block` overrides its fields)."""
    use = {k: v for k, v in {"type": "tool_use", "id": "abcdefghi", "name": "run", "input": {}, **block}.items()
           if v is not None}
    return [*QUESTION, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "abcdefghi", "content": "72"}]}]


OPENAI_MALFORMED = {
    "not UTF-8": b'{"messages": "\xff\xfe"}',
    "not JSON": b"{messages: [",
    "NaN": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    "a list body": b"[1, 2]",
    "tools: [1]": chat(tools=[1]),
    "tools: a dict": chat(tools=PY_TOOL),
    "a tool without a name": chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
    "stream_options: true": chat(stream=True, stream_options=True),
    "stream: 'yes'": chat(stream="yes"),
    "max_tokens: true": chat(max_tokens=True),
    "max_completion_tokens: 0": chat(max_completion_tokens=0),
    "max_tokens: 1.5": chat(max_tokens=1.5),
    "n: true": chat(n=True),
    "n: 2": chat(n=2),
    "temperature: 'hot'": chat(temperature="hot"),
    "temperature: 9": chat(temperature=9),
    "stop: 5": chat(stop=5),
    "stop: [1]": chat(stop=[1]),
    "messages: []": chat(messages=[]),
    "messages: a string": chat(messages="hi"),
    "a message that is a number": chat(messages=[1]),
    "role: wizard": chat(messages=[{"role": "wizard", "content": "hi"}]),
    "content: 5": chat(messages=[{"role": "user", "content": 5}]),
    "a text part without text": chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    "an image part (text-only model)": chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]),
    "tool_calls: [1]": chat(messages=[*QUESTION, {"role": "assistant", "content": "", "tool_calls": [1]}]),
    "tool_choice: 5": chat(tool_choice=5),
    "tool_choice naming no tool": chat(tools=[PY_TOOL], tool_choice="search"),
    "response_format: json_object": chat(response_format={"type": "json_object"}),
    "response_format: 'json'": chat(response_format="json"),
    "top_p: 'all'": chat(top_p="all"),
    # Fields chat templates index as they come: each raised inside a real family's template (tested below).
    "arguments not JSON": chat(messages=[*QUESTION, _called(arguments="not json"), _result()]),
    "arguments a JSON list": chat(messages=[*QUESTION, _called(arguments="[1, 2]"), _result()]),
    "arguments a JSON number": chat(messages=[*QUESTION, _called(arguments="5"), _result()]),
    "a call id that is a number": chat(messages=[*QUESTION, _called(call_id=5), _result()]),
    "a call without an id": chat(messages=[*QUESTION, _called(call_id=None), _result()]),
    "a tool message without tool_call_id": chat(messages=[*QUESTION, _called(), _result(call_id=None)]),
    "tool_call_id a number": chat(messages=[*QUESTION, _called(), _result(call_id=7)]),
    "parameters.properties: 5": chat(tools=[_tool({"type": "object", "properties": 5})]),
    "parameters.properties: a list": chat(tools=[_tool({"type": "object", "properties": [1]})]),
    "parameters.required: 5": chat(tools=[_tool({"type": "object", "properties": {}, "required": 5})]),
    "a nested required: [1]": chat(tools=[_tool({"type": "object", "properties": {
        "x": {"type": "object", "properties": {}, "required": [1]}}})]),
}

ANTHROPIC_MALFORMED = {
    "not UTF-8": b'{"max_tokens": 5, "messages": "\xff"}',
    "not JSON": b"{",
    "a list body": b"[]",
    "content: 5": user(5),
    "stop_sequences: 'END'": claude(stop_sequences="END"),
    "stop_sequences: [1]": claude(stop_sequences=[1]),
    "stop_sequences: 5": claude(stop_sequences=5),
    "an image block": user([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]),
    "a document block": user([{"type": "text", "text": "Summarise:"}, {"type": "document", "source": {}}]),
    "an image in a tool result": claude(messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "run", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}]}]),
    "a block without a type": user([{"text": "hi"}]),
    "an unknown block": user([{"type": "hologram"}]),
    "a text block without text": user([{"type": "text"}]),
    "tool_use from the user": user([{"type": "tool_use", "id": "t", "name": "run", "input": {}}]),
    "tool_use input: a list": claude(messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "run", "input": [1]}]}, *QUESTION]),
    "max_tokens missing": {"model": "p", "messages": QUESTION},
    "max_tokens: true": claude(max_tokens=True),
    "max_tokens: '5'": claude(max_tokens="5"),
    "temperature: 1.5": claude(temperature=1.5),
    "role: system": claude(messages=[{"role": "system", "content": "hi"}]),
    "a message that is a string": claude(messages=["hi"]),
    "messages: {}": claude(messages={}),
    "system: 5": claude(system=5),
    "system: an image": claude(system=[{"type": "image"}]),
    "tools: [1]": claude(tools=[1]),
    "tool_choice: {'type': 'weird'}": claude(tools=[CLAUDE_TOOL], tool_choice={"type": "weird"}),
    "tool_choice: 5": claude(tool_choice=5),
    "tool_choice naming no tool": claude(tools=[CLAUDE_TOOL], tool_choice={"type": "tool", "name": "search"}),
    "a prefill ending in whitespace": claude(messages=[*QUESTION, {"role": "assistant", "content": "It is "}]),
    "a prefill with a tool_use": claude(messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "run", "input": {}}]}]),
    "stream: 1": claude(stream=1),
    "tool_use without an id": claude(tools=[CLAUDE_TOOL], messages=_used(id=None)),
    "tool_use id: 5": claude(tools=[CLAUDE_TOOL], messages=_used(id=5)),
    "input_schema.properties: 5": claude(tools=[{"name": "run", "input_schema": {"type": "object", "properties": 5}}]),
    "input_schema.required: 'code'": claude(tools=[{"name": "run", "input_schema": {"type": "object",
                                                                                    "required": "code"}}]),
}


@pytest.mark.parametrize("case", list(OPENAI_MALFORMED))
def test_malformed_openai_bodies_get_400_in_openai_shape_and_record_nothing(served, case):
    before = len(served[1].calls)
    response = send(served, "POST", "/v1/chat/completions", OPENAI_MALFORMED[case])
    assert_refused(response, anthropic_shape=False)
    assert response.status_code == 400 and len(served[1].calls) == before


@pytest.mark.parametrize("case", list(ANTHROPIC_MALFORMED))
def test_malformed_anthropic_bodies_get_400_in_anthropic_shape_and_record_nothing(served, case):
    before = len(served[1].calls)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = ANTHROPIC_MALFORMED[case]
        if case == "max_tokens missing" and path.endswith("count_tokens"):
            continue  # count_tokens takes no max_tokens
        response = send(served, "POST", path, body)
        assert_refused(response, anthropic_shape=True)
        assert response.status_code == 400, (path, response.text)
    assert len(served[1].calls) == before


@pytest.fixture(scope="module")
def family_served(real_tokenizers):
    """{family: (gateway, tuner)} over each real family's tokenizer and chat template: stricter than SmolLM2's,
    they raise on fields of the wrong type that SmolLM2's prints."""
    out = {}
    for family, tokenizer in real_tokenizers.items():
        gateway = Gateway()
        out[family] = (gateway, make_tuner(tokenizer, [], gateway=gateway)[0])
    yield out
    for gateway, _ in out.values():
        gateway.close()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_malformed_bodies_get_400_under_each_real_familys_template_never_a_500(family_served, family):
    served = family_served[family]
    cases = [("/v1/chat/completions", case, body) for case, body in OPENAI_MALFORMED.items()]
    cases += [(path, case, body) for case, body in ANTHROPIC_MALFORMED.items()
              for path in ("/v1/messages", "/v1/messages/count_tokens")
              if not (case == "max_tokens missing" and path.endswith("count_tokens"))]
    cases += [("/v1/responses", named, body) for body, named in RESPONSES_MALFORMED]
    wrong = []
    for path, case, body in cases:
        response = send(served, "POST", path, body)
        if response.status_code != 400:
            wrong.append(f"{path} {case}: {response.status_code} {response.text[:160]}")
            continue
        assert_refused(response, anthropic_shape=path.startswith("/v1/messages"))
    assert not wrong, "\n".join(wrong)
    assert served[1].calls == []


_FRAGILE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                     "{% if m.content == 'boom' %}{{ m.content + 5 }}{% endif %}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _BrokenEngine(SteadyEngine):
    async def generate(self, prompt_ids, sampling, request_id=None):
        raise TypeError("a bug of ours")


def test_an_exception_inside_the_chat_template_is_a_400_naming_it_and_one_outside_stays_a_500(demo_tokenizer):
    """Templates raise whatever their code hits (a TypeError here, as Qwen3.5's on arguments that are not an
    object): the request's fault, answered 400 on every route. The same exception from our own code is not
    hidden as the client's fault."""
    tokenizer = copy.copy(demo_tokenizer)
    tokenizer.chat_template = _FRAGILE_TEMPLATE
    gateway = Gateway()
    tuner, _ = make_tuner(tokenizer, [], gateway=gateway)
    tuner.engine = SteadyEngine(tokenizer)
    served = (gateway, tuner)
    boom = [{"role": "user", "content": "boom"}]
    for path, body in (("/v1/chat/completions", chat(messages=boom)), ("/v1/messages", claude(messages=boom)),
                       ("/v1/messages/count_tokens", claude(messages=boom)),
                       ("/v1/responses", {"model": "p", "input": "boom"})):
        response = send(served, "POST", path, body)
        assert response.status_code == 400, (path, response.text)
        assert_refused(response, anthropic_shape=path.startswith("/v1/messages"))
        assert "chat template refused" in response.text and "TypeError" in response.text, response.text
    assert send(served, "POST", "/v1/chat/completions", chat()).status_code == 200  # the template works
    tuner.engine = _BrokenEngine(tokenizer)
    response = send(served, "POST", "/v1/chat/completions", chat())
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("method, path, status, anthropic_shape", [
    ("POST", "/v1/nowhere", 404, False),
    ("GET", "/v1/chat/completions", 405, False),
    ("POST", "/v1/models", 405, False),
    ("POST", "/v1/messages/batches", 404, True),
    ("GET", "/v1/messages", 405, True),
    ("GET", "/v1/messages/count_tokens", 405, True),
])
def test_unknown_routes_and_wrong_methods_answer_in_the_apis_error_shape(served, method, path, status,
                                                                         anthropic_shape):
    response = send(served, method, path, chat() if method == "POST" else None)
    assert response.status_code == status
    assert_refused(response, anthropic_shape)
    if status == 405:
        assert response.headers["allow"]


def test_a_wrong_key_gets_401_that_the_sdks_do_not_retry(served):
    for path, body, anthropic_shape in (("/v1/chat/completions", chat(), False), ("/v1/messages", claude(), True),
                                        ("/v1/messages/count_tokens", claude(), True), ("/v1/models", None, False)):
        response = send(served, "POST" if body else "GET", path, body, key="not-a-key")
        assert response.status_code == 401
        assert_refused(response, anthropic_shape)


# --- hypothesis: valid bodies of each API with up to two fields broken, anywhere in the body -------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _mutated(draw, valid: dict, broken: dict, always: tuple[str, ...] = ()) -> dict:
    """Fields with valid values (`valid`: name -> choices; those in `always`, and some others), then up to two
    fields set to a known-bad value or any JSON (which may happen to be valid: the check allows either answer)."""
    out = {name: draw(st.sampled_from(choices)) for name, choices in valid.items()
           if name in always or draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted({*valid, *broken})), max_size=2, unique=True)):
        value = draw(st.sampled_from(broken[name]) | JSON if broken.get(name) else JSON)
        out[name] = draw(value) if isinstance(value, st.SearchStrategy) else value  # a nested fuzzed part
    return out


def _conversation(message: st.SearchStrategy, first: dict) -> st.SearchStrategy:
    return st.lists(message, max_size=3).map(lambda rest: [first, *rest])


OPENAI_MESSAGE = _mutated(
    {"role": ["user", "assistant", "system", "tool"], "content": ["hi", "It is", "", [{"type": "text", "text": "x"}]],
     "tool_call_id": ["c1"]},
    {"role": ["wizard", None], "content": [5, [1], [{"type": "text", "text": 5}], [{"type": "image_url"}]],
     "tool_calls": [[{"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}], [1],
                    [{"function": {"name": 3}}]]}, always=("role", "content"))
OPENAI_BODY = st.tuples(_conversation(OPENAI_MESSAGE, QUESTION[0]), _mutated(
    {"model": ["p"], "tools": [[PY_TOOL]], "tool_choice": ["auto", "none"], "stream": [True, False],
     "stream_options": [{"include_usage": True}], "max_tokens": [1, 8], "max_completion_tokens": [4],
     "n": [1], "temperature": [0, 0.7], "stop": ["It", ["is"]], "top_p": [1, 0.9], "top_k": [20],
     "response_format": [{"type": "text"}]},
    {"messages": [[], "hi", [1]], "tools": [[1], [{"function": {}}], PY_TOOL], "tool_choice": ["run", 5, {}],
     "stream_options": [True], "max_tokens": [0, True, 1.5], "n": [2, True], "temperature": [2.5, "hot"],
     "stop": [[1], 5], "response_format": [{"type": "json_object"}, "json"]})).map(
    lambda pair: {"messages": pair[0], **pair[1]})

CLAUDE_BLOCK = _mutated(
    {"type": ["text"], "text": ["hi", "It is"]},
    {"type": ["tool_use", "tool_result", "thinking", "image", "document", "x", None], "text": [5],
     "thinking": ["hm"], "id": ["t1"], "name": ["run", 3], "input": [{}, [1]], "tool_use_id": ["t1", None],
     "content": ["72", [{"type": "image"}], 5]}, always=("type", "text"))
CLAUDE_MESSAGE = _mutated(
    {"role": ["user", "assistant"], "content": ["hi", "It is", [{"type": "text", "text": "x"}]]},
    {"role": ["system", None], "content": ["end ", 5, st.lists(CLAUDE_BLOCK, max_size=2)]},
    always=("role", "content"))
CLAUDE_BODY = st.tuples(_conversation(CLAUDE_MESSAGE, QUESTION[0]), _mutated(
    {"model": ["p"], "max_tokens": [16, 1], "system": ["Be brief.", [{"type": "text", "text": "Be brief."}]],
     "tools": [[CLAUDE_TOOL]], "tool_choice": [{"type": "auto"}, {"type": "none"}], "stop_sequences": [["is"]],
     "temperature": [0.5, 1], "stream": [True, False], "top_k": [5], "metadata": [{"user_id": "u"}]},
    {"max_tokens": [0, True, "5", None], "messages": [[], {}], "system": [5, [{"type": "image"}]],
     "tools": [[1], [{"name": 3}]], "tool_choice": [{"type": "weird"}, {"type": "tool", "name": "search"}, 5],
     "stop_sequences": ["END", [1]], "temperature": [1.5, "hot"], "stream": [1]})).map(
    lambda pair: {"messages": pair[0], "max_tokens": 16, **pair[1]})

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _check(served, path: str, body: dict, anthropic_shape: bool) -> None:
    tuner = served[1]
    before = len(tuner.calls)
    response = send(served, "POST", path, body)
    if response.status_code == 200:
        recorded = 0 if path.endswith("count_tokens") else 1
        assert len(tuner.calls) == before + recorded
    else:
        assert_refused(response, anthropic_shape)
        assert len(tuner.calls) == before


@FUZZ
@given(body=OPENAI_BODY)
@pytest.mark.slow
def test_fuzzed_openai_bodies_are_answered_or_refused_in_shape_never_a_500(served, body):
    _check(served, "/v1/chat/completions", body, anthropic_shape=False)


@FUZZ
@given(body=CLAUDE_BODY,
       path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_fuzzed_anthropic_bodies_are_answered_or_refused_in_shape_never_a_500(served, body, path):
    _check(served, path, body, anthropic_shape=True)
