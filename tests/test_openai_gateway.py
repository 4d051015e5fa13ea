"""The OpenAI front ends: in-process async/sync clients, the loopback HTTP endpoint (streaming, 401), sampling
arguments, reasoning split, per-agent models, and AgentScope's OpenAIChatModel with its client replaced."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
from conftest import serve_in_thread
from test_model_tuner import ANSWER_TURN, PY_TOOL, TOOL_TURN, assert_recorded_exactly, make_tuner

from astuner.algorithm.samples import episodes_to_samples
from astuner.model_tuner.formats import ThinkReasoningParser
from astuner.model_tuner.tuner import TunerLimits
from astuner.model_tuner.turn import EpisodeOverflow
from astuner.types import Episode, GenerateResult, Task

QUESTION = [{"role": "user", "content": "What is 6*12?"}]



def test_async_client_returns_openai_types_and_records_exact_ids(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, [TOOL_TURN], gateway=gateway)

    async def main():
        client = tuner.get_openai_client()
        assert isinstance(client, openai.AsyncOpenAI)
        return await client.chat.completions.create(model="policy", messages=QUESTION, tools=PY_TOOL)

    resp = asyncio.run(main())
    assert isinstance(resp, openai.types.chat.ChatCompletion)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will compute it."
    (call,) = choice.message.tool_calls
    assert call.function.name == "execute_python_code"
    assert json.loads(call.function.arguments) == {"code": "print(6*12)"}
    assert resp.usage.completion_tokens == len(tuner.calls[0].response_ids)
    assert_recorded_exactly(tuner, engine)


def test_streaming_keeps_exact_ids(demo_tokenizer, gateway):
    text = "The answer is seventy two, computed by hand."
    tuner, engine = make_tuner(demo_tokenizer, [text], gateway=gateway)

    async def main():
        client = tuner.get_openai_client()
        stream = await client.chat.completions.create(model="policy", messages=QUESTION, stream=True,
                                                      stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), usage, finish

    content, usage, finish = asyncio.run(main())
    assert content == text and finish == "stop"
    assert usage.completion_tokens == len(engine.responses[0])
    assert_recorded_exactly(tuner, engine)


def test_reasoning_is_split_out_but_kept_in_the_tokens(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, ["<think>\nsix times twelve\n</think>\n\n72"], gateway=gateway,
                               reasoning_parser=ThinkReasoningParser())

    async def main():
        return await tuner.get_openai_client().chat.completions.create(model="p", messages=QUESTION)

    message = asyncio.run(main()).choices[0].message
    assert message.content == "72"
    assert message.model_extra["reasoning_content"] == "six times twelve"
    assert "<think>" in tuner.calls[0].response_text
    assert demo_tokenizer.decode(tuner.calls[0].response_ids).startswith("<think>")


def test_sampling_arguments_within_limits(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, ["one two three STOP four five", "x"], gateway=gateway)

    async def main():
        client = tuner.get_openai_client()
        first = await client.chat.completions.create(model="p", messages=QUESTION, temperature=0.3,
                                                     max_tokens=100000, stop=["STOP"])
        with pytest.raises(openai.BadRequestError, match="n=1"):
            await client.chat.completions.create(model="p", messages=QUESTION, n=2)
        return first

    first = asyncio.run(main())
    sampling = engine.samplings[0]
    assert sampling.temperature == 0.3 and tuner.calls[0].temperature == 0.3
    assert sampling.max_tokens == 256  # capped by max_tokens_per_turn
    assert first.choices[0].message.content == "one two three "
    recorded = demo_tokenizer.decode(tuner.calls[0].response_ids)
    assert recorded.endswith("STOP") and "four" not in recorded  # cut after the token completing the stop string
    assert len(tuner.calls[0].response_logprobs) == len(tuner.calls[0].response_ids)
    assert len(tuner.calls) == 1  # the refused n=2 request recorded nothing


def test_loopback_endpoint_http_streaming_and_401(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN, ANSWER_TURN], gateway=gateway)

    async def main():
        url, key = tuner.base_url, tuner.api_key
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(timeout=30) as http:
            ok = await http.post(f"{url}/chat/completions", json={"model": "p", "messages": QUESTION},
                                 headers={"Authorization": f"Bearer {key}"})
            models = await http.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"})
            wrong = await http.post(f"{url}/chat/completions", json={"model": "p", "messages": QUESTION},
                                    headers={"Authorization": "Bearer not-a-key"})
            events = []
            async with http.stream("POST", f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                   json={"model": "p", "messages": QUESTION, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            tuner.close()  # the episode ends: its key is revoked
            revoked = await http.post(f"{url}/chat/completions", json={"model": "p", "messages": QUESTION},
                                      headers={"Authorization": f"Bearer {key}"})
        return ok, models, wrong, events, revoked

    ok, models, wrong, events, revoked = asyncio.run(main())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == ANSWER_TURN
    assert models.json()["data"][0]["id"] == tuner.model_name
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    # the ended episode's key: its calls are over (not a wrong key), and nothing is recorded either
    assert revoked.status_code == 408 and revoked.json()["error"]["code"] == "episode_ended"
    assert "has ended" in revoked.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == ANSWER_TURN
    assert len(tuner.calls) == 2  # the refused calls recorded nothing
    assert_recorded_exactly(tuner, engine)


def test_sync_client_from_a_worker_thread_and_refused_on_the_loop(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN], gateway=gateway)

    async def main():
        client = tuner.get_openai_client(sync=True)
        assert isinstance(client, openai.OpenAI)
        with pytest.raises(RuntimeError, match="worker thread"):
            client.chat.completions.create(model="p", messages=QUESTION)  # would deadlock the loop
        return await asyncio.to_thread(client.chat.completions.create, model="p", messages=QUESTION)

    resp = asyncio.run(main())
    assert resp.choices[0].message.content == ANSWER_TURN
    assert_recorded_exactly(tuner, engine)


def test_for_agent_untrained_calls_never_become_samples(demo_tokenizer, gateway):
    tuner, engine = make_tuner(demo_tokenizer, ["plan: multiply", ANSWER_TURN], gateway=gateway)

    async def main():
        planner = tuner.for_agent("planner", trainable=False)
        await planner.get_openai_client().chat.completions.create(model="p", messages=QUESTION)
        await tuner.for_agent("solver").chat(QUESTION)

    asyncio.run(main())
    planner_call, solver_call = tuner.calls
    assert (planner_call.agent, planner_call.trainable) == ("planner", False)
    assert (solver_call.agent, solver_call.trainable) == ("solver", True)
    tasks = [Task("t", "q")]
    episodes = [Episode(tasks[0], i, f"e{i}", calls=list(tuner.calls), reward=float(i)) for i in range(2)]
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=4)
    assert len(samples) == 2 and all(s.response_ids == solver_call.response_ids for s in samples)


def test_agentscope_openai_chat_model_with_the_episode_client(demo_tokenizer, gateway):
    """Trinity-RFT's pattern: AgentScope's OpenAIChatModel with `client` replaced, inside a ReActAgent.

    stream=False: AgentScope 1.0.21's streaming reader tests `"data" in delta.audio`, which fails on every
    server with openai>=3 (its ChoiceDelta has `audio=None`); streaming itself is tested with the raw client."""
    from agentscope.agent import ReActAgent
    from agentscope.formatter import OpenAIChatFormatter
    from agentscope.memory import InMemoryMemory
    from agentscope.message import Msg
    from agentscope.model import OpenAIChatModel
    from agentscope.tool import Toolkit

    from astuner.tools import execute_python_code

    tuner, engine = make_tuner(demo_tokenizer, [TOOL_TURN, ANSWER_TURN], gateway=gateway)

    async def main():
        model = OpenAIChatModel(model_name="policy", api_key="unused", stream=False)
        model.client = tuner.get_openai_client()
        toolkit = Toolkit()
        toolkit.register_tool_function(execute_python_code)
        agent = ReActAgent(name="Solver", sys_prompt="You solve math problems.", model=model,
                           formatter=OpenAIChatFormatter(), toolkit=toolkit, memory=InMemoryMemory(), max_iters=2)
        agent.set_console_output_enabled(False)
        return await agent(Msg("user", "What is 6*12?", "user"))

    reply = asyncio.run(main())
    assert "\\boxed{72}" in reply.get_text_content()
    first, second = tuner.calls
    assert "<stdout>72\n</stdout>" in demo_tokenizer.decode(second.prompt_ids)
    # Token-exact multi-turn through a real framework: the second prompt is the first prompt + response + more.
    assert second.extends_previous
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == (
        first.prompt_ids + first.response_ids)
    assert_recorded_exactly(tuner, engine)


class HangingEngine:
    """Never answers until the episode's deadline aborts the request (as the engines do: the awaiting task is
    cancelled)."""

    def __init__(self):
        self.waiting = {}

    async def generate(self, prompt_ids, sampling, request_id=None):
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        return await future

    def abort(self, request_id):
        future = self.waiting.pop(request_id, None)
        if future is not None:
            future.get_loop().call_soon_threadsafe(future.cancel)


def test_a_call_cut_by_the_deadline_gets_408_without_a_server_traceback(demo_tokenizer, gateway, caplog):
    tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)
    tuner.engine = HangingEngine()

    async def main():
        url, key = tuner.base_url, tuner.api_key
        async with httpx.AsyncClient(timeout=30) as http:
            request = asyncio.ensure_future(http.post(f"{url}/chat/completions", headers={
                "Authorization": f"Bearer {key}"}, json={"model": "p", "messages": QUESTION}))
            while not tuner.engine.waiting:
                await asyncio.sleep(0.01)
            tuner.expire("episode timed out after 1s")  # what the rollout does at the deadline
            return await request

    with caplog.at_level("DEBUG"):
        resp = asyncio.run(main())
    assert resp.status_code == 408 and resp.json()["error"]["code"] == "episode_timeout"
    assert "Traceback" not in caplog.text and "CancelledError" not in caplog.text


def test_tool_choice_is_checked_and_a_choice_naming_no_tool_is_refused(demo_tokenizer, gateway):
    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN, TOOL_TURN, TOOL_TURN], gateway=gateway)
    named = {"type": "function", "function": {"name": "execute_python_code"}}

    async def main():
        client = tuner.get_openai_client()
        create = client.chat.completions.create
        plain = await create(model="p", messages=QUESTION, tools=PY_TOOL, tool_choice="required")
        called = await create(model="p", messages=QUESTION, tools=PY_TOOL, tool_choice=named)
        with pytest.raises(openai.BadRequestError, match="'search'"):
            await create(model="p", messages=QUESTION, tools=PY_TOOL,
                         tool_choice={"type": "function", "function": {"name": "search"}})
        other = await tuner.chat(QUESTION, [{"type": "function", "function": {"name": "search", "parameters": {}}},
                                            *PY_TOOL])
        return plain, called, other

    plain, called, other = asyncio.run(main())
    # Not constrained (the recorded logprobs stay the policy's own): checked, and a broken choice is flagged.
    assert plain.choices[0].message.content == ANSWER_TURN
    assert tuner.calls[0].flags == ["wrong_toolcall"]
    assert "tool_choice required a tool call, none was made" in tuner.flag_reasons[0][2]
    assert called.choices[0].message.tool_calls[0].function.name == "execute_python_code"
    assert tuner.calls[1].flags == [] and len(tuner.calls) == 3  # the refused request recorded nothing
    assert other["tool_calls"] and tuner.calls[2].flags == []


def test_agentscope_tool_choice_names_a_function(demo_tokenizer):
    tuner, _ = make_tuner(demo_tokenizer, [TOOL_TURN])
    asyncio.run(tuner(QUESTION, tools=PY_TOOL + [{"type": "function", "function": {"name": "search"}}],
                      tool_choice="search"))
    assert tuner.calls[0].flags == ["wrong_toolcall"]
    assert "required a call to 'search', the model called 'execute_python_code'" in tuner.flag_reasons[0][2]


class GatedEngine:
    """Holds every request until the test releases it, then answers `max_tokens` tokens (the most it may)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.held, self.samplings = tokenizer, [], []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.samplings.append(sampling)
        gate = asyncio.get_running_loop().create_future()
        self.held.append(gate)
        await gate
        ids = self.tokenizer.encode(" seventy" * sampling.max_tokens, add_special_tokens=False)
        ids = ids[: sampling.max_tokens]
        return GenerateResult(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="length")

    def abort(self, request_id):
        pass


async def _settle(rounds: int = 300) -> None:
    """Let every task on the loop run as far as it can (the ASGI transport does no I/O: only scheduling)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_parallel_calls_on_one_key_together_stay_within_the_episode_token_budget(demo_tokenizer, gateway):
    limits = TunerLimits(max_model_len=4096, max_tokens_per_turn=256, max_response_tokens=40, max_prompt_length=2048)
    tuner, _ = make_tuner(demo_tokenizer, [], limits=limits, gateway=gateway)
    tuner.engine = engine = GatedEngine(demo_tokenizer)

    async def main():
        client = tuner.get_openai_client()
        asks = [{"max_tokens": 10}, {}, {}]
        tasks = [asyncio.ensure_future(client.chat.completions.create(model="p", messages=QUESTION, **ask))
                 for ask in asks]
        while not all(t.done() for t in tasks):
            await _settle()
            if engine.held:
                engine.held.pop(0).set_result(None)  # the oldest call finishes; the rest wait their turn
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, second, third = asyncio.run(main())
    # The first reserved its 10 tokens, the second the 30 left; the third waited for them and found none.
    assert [s.max_tokens for s in engine.samplings] == [10, 30]
    assert first.usage.completion_tokens == 10 and second.usage.completion_tokens == 30
    assert isinstance(third, openai.BadRequestError) and "budget 40" in str(third)
    assert sum(len(c.response_ids) for c in tuner.calls) == 40


class LoopEngine(HangingEngine):
    """Answers at once, noting the event loop each call ran on."""

    def __init__(self, tokenizer):
        super().__init__()
        self.ids, self.loops = tokenizer.encode("It is 72.", add_special_tokens=False), []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.loops.append(asyncio.get_running_loop())
        return GenerateResult(token_ids=self.ids, logprobs=[-0.1] * len(self.ids), finish_reason="stop")


def test_a_key_first_taken_in_a_worker_thread_still_runs_its_calls_on_the_episodes_loop(demo_tokenizer, gateway):
    """A sync agent in asyncio.to_thread reading tuner.base_url / tuner.api_key (the documented pattern): its
    calls run on the episode's loop, with the episode's budget and its waiters, not on the server's thread."""

    async def episode():
        tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)  # built in the episode, as the rollout does
        tuner.engine = engine = LoopEngine(demo_tokenizer)

        def sync_agent():
            client = openai.OpenAI(base_url=tuner.base_url, api_key=tuner.api_key, max_retries=0)
            return client.chat.completions.create(model="p", messages=QUESTION).choices[0].message.content

        return await asyncio.to_thread(sync_agent), engine.loops, asyncio.get_running_loop()

    answer, loops, episode_loop = asyncio.run(episode())
    assert answer == "It is 72." and loops == [episode_loop]


@pytest.mark.parametrize("path, body, anthropic_shape", [
    ("/v1/chat/completions", {"model": "p", "messages": QUESTION}, False),
    ("/v1/messages", {"model": "p", "max_tokens": 16, "messages": QUESTION}, True),
    ("/v1/responses", {"model": "p", "input": "What is 6*12?"}, False),
])
def test_a_call_still_running_when_its_episode_ends_gets_408_in_the_apis_shape(demo_tokenizer, gateway, path, body,
                                                                               anthropic_shape):
    """The episode ended (its workflow returned) while an agent's HTTP call was generating: the rollout cancels
    what the episode left on its loop. The client reads a 408 it will not retry, not a plain-text 500."""
    from astuner.rollout import _cancel_leftovers

    loop, answered = asyncio.new_event_loop(), {}

    async def episode():
        tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)
        tuner.engine = engine = HangingEngine()
        url, key = tuner.base_url.removesuffix("/v1"), tuner.api_key
        agent = threading.Thread(target=lambda: answered.update(response=httpx.post(
            url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)))
        agent.start()
        while not engine.waiting:
            await asyncio.sleep(0.01)
        return tuner, agent  # the workflow returns, its agent's call still running

    tuner, agent = loop.run_until_complete(episode())
    _cancel_leftovers(loop)
    agent.join(timeout=30)
    loop.close()
    response = answered["response"]
    assert response.status_code == 408 and response.headers["x-should-retry"] == "false", response.text
    error = response.json()["error"]
    assert error["type"] == ("timeout_error" if anthropic_shape else "timeout") and "episode ended" in error["message"]
    assert tuner.calls == []


def test_a_call_refused_while_another_held_the_budget_does_not_overflow_the_episode_once_that_one_is_discarded(
        demo_tokenizer):
    limits = TunerLimits(max_model_len=4096, max_tokens_per_turn=40, max_response_tokens=40, max_prompt_length=2048)
    tuner, engine = make_tuner(demo_tokenizer, ["word " * 60, ANSWER_TURN], limits=limits)

    async def main():
        unread = await tuner.complete(QUESTION, None)  # spends the whole budget; its client hangs up next
        with pytest.raises(EpisodeOverflow):
            await tuner.complete(QUESTION, None)  # a parallel call arriving before the hang-up is handled
        tuner.discard(unread.call)
        return await tuner.complete(QUESTION, None)  # the retry

    retry = asyncio.run(main())
    assert retry.content == ANSWER_TURN and not tuner.overflowed
    assert [c.response_ids for c in tuner.calls] == [engine.responses[1]]


def _http_scope(path: str, key: str) -> dict:
    # What uvicorn sends (its HTTP/1.1 implementations declare ASGI spec 2.3, where Starlette streams while
    # listening for http.disconnect, and a send after the client left is dropped without an error).
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
            "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]}


async def _hang_up(app, path: str, key: str, body: dict, when: str) -> list[dict]:
    """One request from a client that leaves: "while generating" (as uvicorn reports it: http.disconnect is
    there to read once the call is done, and a send to the client that left is dropped), or "while sending"
    (a server whose send fails once the connection is reset, after the first chunk of a stream)."""
    incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()
    if when == "while generating":
        gone.set()
    sent: list[dict] = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await gone.wait()  # still connected: nothing more to read
        return {"type": "http.disconnect"}

    async def send(message):
        if when == "while sending" and message["type"] == "http.response.body" and sent[1:]:
            raise OSError("connection reset by peer")
        if gone.is_set():
            return  # uvicorn drops a send to a client that left
        sent.append(message)

    await app(_http_scope(path, key), receive, send)  # a client gone is no error of the server's
    return sent


@pytest.mark.parametrize("path, body, when", [
    ("/v1/chat/completions", {"model": "p", "messages": QUESTION}, "while generating"),
    ("/v1/chat/completions", {"model": "p", "messages": QUESTION, "stream": True}, "while sending"),
    ("/v1/messages", {"model": "p", "max_tokens": 64, "messages": QUESTION}, "while generating"),
    ("/v1/messages", {"model": "p", "max_tokens": 64, "messages": QUESTION, "stream": True}, "while sending"),
    ("/v1/responses", {"model": "p", "input": QUESTION}, "while generating"),
    ("/v1/responses", {"model": "p", "input": QUESTION, "stream": True}, "while generating"),
    ("/v1/responses", {"model": "p", "input": QUESTION, "stream": True}, "while sending"),
])
def test_a_call_whose_client_hung_up_is_not_trained_and_its_retry_is(demo_tokenizer, gateway, path, body, when):
    tuner, engine = make_tuner(demo_tokenizer, ["An answer nobody read.", ANSWER_TURN], gateway=gateway)

    async def main():
        await _hang_up(gateway.app, path, tuner.api_key, body, when)
        assert tuner.calls == []  # un-recorded before the retry comes
        return await tuner.get_openai_client().chat.completions.create(model="p", messages=QUESTION)

    retry = asyncio.run(main())
    assert retry.choices[0].message.content == ANSWER_TURN
    (call,) = tuner.calls
    assert call.response_ids == engine.responses[1] and tuner.generated_tokens == len(engine.responses[1])
    episodes = [Episode(Task("t", "q"), i, f"e{i}", calls=list(tuner.calls), reward=float(i)) for i in range(2)]
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                                  max_sample_per_task=4)
    assert [s.response_ids for s in samples] == [engine.responses[1]] * 2  # only the delivered answer trains


def test_a_refusal_carries_x_should_retry_false_so_the_sdk_does_not_retry_it(demo_tokenizer, gateway):
    """The SDKs retry 408 by default; an expired episode's 408 fails the same way every time."""
    tuner, _ = make_tuner(demo_tokenizer, [], gateway=gateway)
    tuner.expire("episode timed out after 1s")
    seen: list[int] = []

    async def count(request):
        seen.append(1)

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), event_hooks={"request": [count]})
        client = openai.AsyncOpenAI(api_key=tuner.api_key, base_url="http://astuner.local/v1", http_client=http,
                                    max_retries=2)
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="p", messages=QUESTION)
        return refused.value

    refused = asyncio.run(main())
    assert refused.status_code == 408 and refused.response.headers["x-should-retry"] == "false"
    assert len(seen) == 1


# Small socket buffers on both ends: the stream outgrows what the connection can hold unread, so the server is
# still sending when the client closes after its first chunk (no timing involved). A client reading it all gets
# the usual buffers (small ones make a long stream crawl).
_SMALL_BUFFERS = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096), (socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "p", "messages": QUESTION, "stream": True}),
    ("/v1/messages", {"model": "p", "max_tokens": 6000, "messages": QUESTION, "stream": True}),
    ("/v1/responses", {"model": "p", "input": QUESTION, "stream": True}),
])
@pytest.mark.parametrize("reads", ["one chunk", "the whole stream"])
def test_a_stream_left_after_its_first_chunk_under_uvicorn_is_not_recorded_and_one_read_whole_is(
        demo_tokenizer, gateway, path, body, reads):
    """uvicorn drops sends to a client that left without an error; the gateway must hear the disconnect."""
    limits = TunerLimits(max_model_len=8192, max_tokens_per_turn=6000, max_response_tokens=6000,
                         max_prompt_length=2048)
    long_answer = ("-" * 64 + " ") * 4000  # 260 kB in 4,001 tokens: far more than the buffers hold
    tuner, engine = make_tuner(demo_tokenizer, [long_answer], limits=limits, gateway=gateway)
    handled = threading.Event()

    async def app(scope, receive, send):  # the gateway's app, telling when it is done with the request
        try:
            await gateway.app(scope, receive, send)
        finally:
            handled.set()

    buffers = _SMALL_BUFFERS if reads == "one chunk" else []
    url, stop = serve_in_thread(app, socket_options=buffers)

    async def main():
        transport = httpx.AsyncHTTPTransport(socket_options=buffers)
        async with httpx.AsyncClient(transport=transport, timeout=60) as http:
            async with http.stream("POST", url + path, json=body,
                                   headers={"Authorization": f"Bearer {tuner.api_key}"}) as resp:
                assert resp.status_code == 200
                async for _ in resp.aiter_raw():
                    if reads == "one chunk":
                        break  # leaving the block closes the connection mid-stream
        assert await asyncio.to_thread(handled.wait, 60), "the gateway never finished the request"
        await asyncio.sleep(0)  # the un-recording is handed to this (the episode's) loop before `handled`

    try:
        asyncio.run(main())
    finally:
        stop()
    assert len(tuner.calls) == (0 if reads == "one chunk" else 1)
    assert tuner.generated_tokens == (0 if reads == "one chunk" else len(engine.responses[0]))


def test_a_body_over_the_limit_is_413_in_each_apis_shape_and_unknown_routes_answer_in_the_callers(demo_tokenizer,
                                                                                                   gateway):
    """The endpoint remote agents reach over the network reads no body past MAX_BODY_BYTES (it stops reading
    there), and answers 413 in the shape of the API called; a route that does not exist answers in Anthropic's shape
    to an Anthropic client (its `anthropic-version` header), wherever it points."""
    from astuner.model_tuner.frontends.gateway_http import MAX_BODY_BYTES

    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN], gateway=gateway)
    huge = b'{"model": "p", "messages": [], "pad": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'

    async def main():
        url, key = tuner.base_url, tuner.api_key
        async with httpx.AsyncClient(timeout=60) as http:
            chat = await http.post(f"{url}/chat/completions", content=huge,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            anthropic = await http.post(f"{url}/messages", content=huge, headers={
                "x-api-key": key, "anthropic-version": "2023-06-01", "Content-Type": "application/json"})
            unknown = await http.post(f"{url}/nothing/here", json={}, headers={
                "x-api-key": key, "anthropic-version": "2023-06-01"})
        return chat, anthropic, unknown

    chat, anthropic, unknown = asyncio.run(main())
    assert chat.status_code == 413 and chat.json()["error"]["code"] == "request_too_large"
    assert anthropic.status_code == 413 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "request_too_large"
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert not tuner.calls
