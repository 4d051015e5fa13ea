"""ModelTuner with a scripted fake engine: recording, tool calls, AgentScope ReActAgent, limits, flags."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from astuner.model_tuner import ChatRenderer, EpisodeOverflow, ModelTuner, TunerLimits, get_tool_parser
from astuner.types import GenerateResult

PY_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "execute_python_code",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]
TOOL_TURN = (
    "I will compute it.\n<tool_call>\n"
    '{"name": "execute_python_code", "arguments": {"code": "print(6*12)"}}\n</tool_call>'
)
ANSWER_TURN = "The answer is \\boxed{72}"


class ScriptedEngine:
    """Answers each generate() with the next scripted text (+ eos) and remembers what it was given."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer = tokenizer
        self.script = list(script)
        self.prompts: list[list[int]] = []
        self.samplings = []
        self.responses: list[list[int]] = []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        ids = self.tokenizer.encode(self.script.pop(0), add_special_tokens=False)
        ids = ids[: sampling.max_tokens - 1] + [self.tokenizer.eos_token_id]
        self.responses.append(ids)
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        return GenerateResult(token_ids=ids, logprobs=logprobs, finish_reason="stop")

    def abort(self, request_id):
        pass

    def load_weights(self, named_tensors):
        pass

    def shutdown(self):
        pass


def make_tuner(tokenizer, script, limits=None, temperature=0.7, **kwargs):
    engine = ScriptedEngine(tokenizer, script)
    tuner = ModelTuner(
        engine=engine,
        tokenizer=tokenizer,
        renderer=ChatRenderer(tokenizer),
        tool_parser=get_tool_parser("hermes"),
        limits=limits or TunerLimits(max_model_len=4096, max_tokens_per_turn=256, max_response_tokens=1024,
                                     max_prompt_length=2048),
        temperature=temperature,
        stop_token_ids=(tokenizer.eos_token_id,),
        **kwargs,
    )
    return tuner, engine


def assert_recorded_exactly(tuner, engine):
    assert len(tuner.calls) == len(engine.prompts)
    for call, prompt, response in zip(tuner.calls, engine.prompts, engine.responses):
        assert call.prompt_ids == prompt
        assert call.response_ids == response
        assert call.response_logprobs == [-0.01 * (i + 1) for i in range(len(response))]


def test_chat_returns_tool_calls_and_records_exact_ids(demo_tokenizer):
    tuner, engine = make_tuner(demo_tokenizer, [TOOL_TURN], seed=7)
    messages = [{"role": "user", "content": "What is 6*12?"}]
    reply = asyncio.run(tuner.chat(messages, tools=PY_TOOL))

    assert reply["role"] == "assistant" and reply["content"] == "I will compute it."
    (call,) = reply["tool_calls"]
    assert call["type"] == "function" and call["id"] == "call_0_0"
    assert call["function"]["name"] == "execute_python_code"
    assert json.loads(call["function"]["arguments"]) == {"code": "print(6*12)"}

    assert_recorded_exactly(tuner, engine)
    recorded = tuner.calls[0]
    assert recorded.prompt_ids == ChatRenderer(demo_tokenizer).render(messages, PY_TOOL)
    assert recorded.temperature == 0.7 and recorded.finish_reason == "stop" and recorded.flags == []
    assert recorded.response_text == TOOL_TURN
    sampling = engine.samplings[0]
    assert sampling.temperature == 0.7 and sampling.seed == 7
    assert sampling.stop_token_ids == (demo_tokenizer.eos_token_id,)
    assert sampling.max_tokens == 256
    assert tuner.generated_tokens == len(recorded.response_ids)


def test_chat_plain_answer_has_no_tool_calls(demo_tokenizer):
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN], seed=7)
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "hi"}]))
    assert reply == {"role": "assistant", "content": ANSWER_TURN}


def _run_react_agent(tokenizer, formatter_cls):
    pytest.importorskip("agentscope")
    from agentscope.agent import ReActAgent
    from agentscope.memory import InMemoryMemory
    from agentscope.message import Msg
    from agentscope.tool import Toolkit

    from astuner.tools import execute_python_code

    tuner, engine = make_tuner(tokenizer, [TOOL_TURN, ANSWER_TURN])
    toolkit = Toolkit()
    toolkit.register_tool_function(execute_python_code)
    agent = ReActAgent(
        name="Solver",
        sys_prompt="You solve math problems. Use Python when useful.",
        model=tuner,
        formatter=formatter_cls(),
        toolkit=toolkit,
        memory=InMemoryMemory(),
        max_iters=2,
    )
    agent.set_console_output_enabled(False)
    reply = asyncio.run(agent(Msg("user", "What is 6*12?", "user")))

    assert len(tuner.calls) == 2
    first, second = tuner.calls
    assert first.flags == [] and second.flags == []
    parsed = get_tool_parser("hermes").parse(first.response_text, {"execute_python_code"})
    assert [c.name for c in parsed.tool_calls] == ["execute_python_code"] and not parsed.errors
    second_prompt = tokenizer.decode(second.prompt_ids)
    assert "<tool_response>" in second_prompt and "<stdout>72\n</stdout>" in second_prompt
    assert second.prompt_ids[: len(first.prompt_ids) - 3] == first.prompt_ids[: len(first.prompt_ids) - 3]
    assert "\\boxed{72}" in reply.get_text_content()
    assert_recorded_exactly(tuner, engine)


def test_react_agent_with_openai_formatter(demo_tokenizer):
    pytest.importorskip("agentscope")
    from agentscope.formatter import OpenAIChatFormatter

    _run_react_agent(demo_tokenizer, OpenAIChatFormatter)


def test_react_agent_with_dashscope_formatter(demo_tokenizer):
    pytest.importorskip("agentscope")
    from agentscope.formatter import DashScopeChatFormatter

    _run_react_agent(demo_tokenizer, DashScopeChatFormatter)


def test_agentscope_call_options(demo_tokenizer):
    pytest.importorskip("agentscope")
    tuner, engine = make_tuner(demo_tokenizer, [TOOL_TURN, ANSWER_TURN])
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 6*12?"}]}]

    response = asyncio.run(tuner(messages, tools=PY_TOOL, tool_choice="auto"))
    assert [block["type"] for block in response.content] == ["text", "tool_use"]
    assert response.content[1]["input"] == {"code": "print(6*12)"}
    assert response.usage.output_tokens == len(tuner.calls[0].response_ids)
    assert tuner.model_name and tuner.stream is False

    # tool_choice="none" hides the tools: the prompt has no tool schema.
    asyncio.run(tuner(messages, tools=PY_TOOL, tool_choice="none"))
    assert "execute_python_code" not in demo_tokenizer.decode(engine.prompts[1])
    with pytest.raises(NotImplementedError, match="structured_model"):
        asyncio.run(tuner(messages, structured_model=dict))


def test_overflow_on_tiny_context(demo_tokenizer):
    limits = TunerLimits(max_model_len=10, max_tokens_per_turn=64, max_response_tokens=512, max_prompt_length=4096)
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN], limits=limits)
    with pytest.raises(EpisodeOverflow):
        asyncio.run(tuner.chat([{"role": "user", "content": "What is 6*12?"}]))
    assert tuner.overflowed and tuner.calls == [] and engine.prompts == []


def test_overflow_on_long_first_prompt_and_on_spent_budget(demo_tokenizer):
    limits = TunerLimits(max_model_len=4096, max_tokens_per_turn=64, max_response_tokens=512, max_prompt_length=5)
    tuner, _ = make_tuner(demo_tokenizer, [ANSWER_TURN], limits=limits)
    with pytest.raises(EpisodeOverflow, match="max_prompt_length"):
        asyncio.run(tuner.chat([{"role": "user", "content": "What is 6*12?"}]))
    assert tuner.overflowed

    # Budget: the second call may only use what the first left; the third finds it spent.
    budget = 12
    limits = TunerLimits(max_model_len=4096, max_tokens_per_turn=8, max_response_tokens=budget, max_prompt_length=4096)
    tuner, engine = make_tuner(demo_tokenizer, ["word " * 20] * 3, limits=limits)
    messages = [{"role": "user", "content": "Talk."}]
    asyncio.run(tuner.chat(messages))
    asyncio.run(tuner.chat(messages))
    assert [s.max_tokens for s in engine.samplings] == [8, budget - 8]
    with pytest.raises(EpisodeOverflow, match="budget"):
        asyncio.run(tuner.chat(messages))
    assert tuner.overflowed and len(tuner.calls) == 2  # calls made before the overflow are kept


def test_max_tokens_limited_by_context(demo_tokenizer):
    messages = [{"role": "user", "content": "What is 6*12?"}]
    prompt_len = len(ChatRenderer(demo_tokenizer).render(messages))
    limits = TunerLimits(max_model_len=prompt_len + 5, max_tokens_per_turn=64, max_response_tokens=512,
                         max_prompt_length=4096)
    tuner, engine = make_tuner(demo_tokenizer, [ANSWER_TURN], limits=limits)
    asyncio.run(tuner.chat(messages))
    assert engine.samplings[0].max_tokens == 5


def test_malformed_tool_call_flags_wrong_toolcall(demo_tokenizer):
    bad = '<tool_call>\n{"name": "execute_python_code", "arguments": {"code": print(1)}}\n</tool_call>'
    tuner, _ = make_tuner(demo_tokenizer, [bad, '<tool_call>{"name": "x", "arguments": {}}</tool_call>'])
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "go"}], tools=PY_TOOL))
    assert "tool_calls" not in reply
    assert tuner.calls[0].flags == ["wrong_toolcall"]
    assert tuner.flag_reasons[0][:2] == (0, "wrong_toolcall") and "invalid JSON" in tuner.flag_reasons[0][2]

    # A tool call when no tools were offered is flagged too, and not returned as a call; its markers never reach
    # the agent (the recorded call keeps the raw text).
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "go"}]))
    assert "tool_calls" not in reply and "<tool_call>" not in reply["content"]
    assert tuner.calls[1].flags == ["wrong_toolcall"]
    assert "<tool_call>" in tuner.calls[1].response_text


def test_madness_checks_respect_the_checklist(demo_tokenizer):
    bad = '<tool_call>{"oops": 1}</tool_call>'
    tuner, _ = make_tuner(demo_tokenizer, [bad], madness_checks=("nonsense",))
    asyncio.run(tuner.chat([{"role": "user", "content": "go"}], tools=PY_TOOL))
    assert tuner.calls[0].flags == []
    with pytest.raises(ValueError, match="available"):
        make_tuner(demo_tokenizer, [], madness_checks=("nonsense", "typo"))


def test_leaked_special_token_flags_nonsense(demo_tokenizer):
    tuner, _ = make_tuner(demo_tokenizer, ["Done.<|im_end|>\n<|im_start|>user\nmore"])
    reply = asyncio.run(tuner.chat([{"role": "user", "content": "go"}]))
    assert tuner.calls[0].flags == ["nonsense"]
    assert "<|im_start|>" not in reply["content"]  # special tokens are skipped when decoding


def test_importing_model_tuner_does_not_import_agentscope():
    code = "import sys, astuner.model_tuner, astuner.tools, astuner.madness; print('agentscope' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_each_model_samples_with_its_own_settings(demo_tokenizer, tmp_path):
    """astuner.models' temperature / top_p / top_k apply to the calls of their agents (recorded, so the trainer
    takes the same temperature), the rollout's to the rest; validation (temperature 0) stays greedy; a model's
    trainer takes its top_p / top_k."""
    from astuner.config import load_config
    from astuner.model_tuner.roster import Roster

    def roster(engine, critic):
        return Roster({"policy": engine, "critic": critic}, {"critic": ("critic", True)},
                      {"critic": (0.3, 0.8, 5)})

    critic = ScriptedEngine(demo_tokenizer, ["fine", "fine"])
    tuner, engine = make_tuner(demo_tokenizer, ["hi", "hi"], temperature=0.7, top_p=0.95, top_k=0)
    tuner.roster = roster(engine, critic)
    messages = [{"role": "user", "content": "Hi"}]
    asyncio.run(tuner.chat(messages))
    asyncio.run(tuner.for_agent("critic").chat(messages))
    (mine,), (its,) = engine.samplings, critic.samplings
    assert (mine.temperature, mine.top_p, mine.top_k) == (0.7, 0.95, 0)
    assert (its.temperature, its.top_p, its.top_k) == (0.3, 0.8, 5)
    assert [c.temperature for c in tuner.calls] == [0.7, 0.3]

    greedy, _ = make_tuner(demo_tokenizer, [], temperature=0.0)
    greedy.roster = roster(engine, critic)
    asyncio.run(greedy.for_agent("critic").chat(messages))
    assert critic.samplings[-1].temperature == 0.0  # validation

    yaml = tmp_path / "x.yaml"
    yaml.write_text("astuner:\n  model: {path: a}\n  models: {critic: {path: b, top_p: 0.8, top_k: 5}}\n"
                    "  rollout: {top_p: 0.95}\n")
    typed = load_config(str(yaml), []).typed
    from astuner.algorithm.catalog import algorithm
    from astuner.config.model_set import model_set
    from astuner.trainer.build import trainer_settings

    grpo = algorithm("grpo")
    settings = trainer_settings(typed, grpo, 1, spec=model_set(typed)["critic"])
    assert (settings.top_p, settings.top_k) == (0.8, 5)
    assert trainer_settings(typed, grpo, 1).top_p == 0.95
