"""`astuner warmstart`: demonstrations with made-up twins of the agent's tools (astuner/tool_demos.py), read back
by each family's tool parser through the SFT's own rendering, the tools read from a dry run of the agent
quick-start's workflow, and the command end to end on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO

TUTORIAL = REPO / "tutorial" / "agent_quickstart"

# A schema no pool of the generator was written for: a string enum, a number with bounds, a nested object (with an
# array and an optional boolean inside), and an optional integer.
BOOK_HALL = {"type": "function", "function": {
    "name": "book_concert_hall",
    "description": "Books a concert hall for an orchestra rehearsal.",
    "parameters": {"type": "object", "properties": {
        "hall_kind": {"type": "string", "enum": ["chamber", "symphonic", "recital"], "description": "Hall kind."},
        "budget_usd": {"type": "number", "minimum": 100, "maximum": 20000, "description": "Spend cap."},
        "rehearsal": {"type": "object", "description": "Rehearsal details.", "properties": {
            "conductor": {"type": "string"},
            "pieces": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "recorded": {"type": "boolean"}},
            "required": ["conductor", "pieces"]},
        "encore_minutes": {"type": "integer", "description": "Optional encore length."}},
        "required": ["hall_kind", "budget_usd", "rehearsal"]}}}
TUNE_PIANO = {"type": "function", "function": {
    "name": "tune_piano", "description": "Tunes a piano by serial.",
    "parameters": {"type": "object", "properties": {"serial": {"type": "string"}}, "required": ["serial"]}}}
USER_TOOLS = [BOOK_HALL, TUNE_PIANO]
USER_WORDS = {"book_concert_hall", "tune_piano", "hall_kind", "budget_usd", "rehearsal", "conductor", "pieces",
              "recorded", "encore_minutes", "serial", "chamber", "symphonic", "recital"}
USER_DESCRIPTIONS = ["Books a concert hall", "orchestra", "Spend cap", "Rehearsal details", "encore length",
                     "Tunes a piano"]


def conformity(value, schema: dict, where: str = "arguments") -> list[str]:
    """What in `value` breaks `schema` (types, enums, required and unknown properties, bounds, array sizes)."""
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if types else []
    checks = {"string": lambda v: isinstance(v, str), "integer": lambda v: type(v) is int,
              "number": lambda v: type(v) in (int, float), "boolean": lambda v: type(v) is bool,
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "null": lambda v: v is None}
    if types and not any(checks[t](value) for t in types):
        return [f"{where}: {value!r} is not {'/'.join(types)}"]
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
        problems.append(f"{where}: {value!r} out of bounds")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        problems += [f"{where}: {k} is required" for k in schema.get("required", []) if k not in value]
        problems += [f"{where}: {k} is not in the schema" for k in value if k not in properties]
        for k, v in value.items():
            problems += conformity(v, properties.get(k, {}), f"{where}.{k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{where}: fewer than minItems")
        for i, v in enumerate(value):
            problems += conformity(v, schema.get("items", {}), f"{where}[{i}]")
    return problems


def shape(schema: dict) -> object:
    """A schema without its names: types, required flags, enum sizes, nesting (what a twin must keep)."""
    if "properties" in schema:
        required = set(schema.get("required", []))
        return ("object", [(k in required, shape(v)) for k, v in schema["properties"].items()])
    if schema.get("type") == "array":
        return ("array", shape(schema.get("items", {})))
    return (schema.get("type"), len(schema.get("enum", [])))


def calls_of(row: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in row["messages"] for c in m.get("tool_calls") or []]


def test_twins_of_an_unseen_schema_keep_its_shapes_and_none_of_its_names():
    from astuner.tool_demos import demonstrations

    rows = demonstrations(USER_TOOLS, count=24, seed=3)
    assert len(rows) == 24
    assert rows == demonstrations(USER_TOOLS, count=24, seed=3)  # pure and seeded
    assert rows != demonstrations(USER_TOOLS, count=24, seed=4)
    chains = 0
    optional_passed = set()
    for row in rows:
        text = json.dumps(row).lower()
        assert not [w for w in USER_WORDS if f'"{w}"' in text or f" {w} " in text], text
        assert not [d for d in USER_DESCRIPTIONS if d.lower() in text]
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
        # Every user tool has a twin of its shape among the offered tools.
        shapes = [shape(p) for p in offered.values()]
        for tool in USER_TOOLS:
            assert shape(tool["function"]["parameters"]) in shapes
        for t in row["tools"]:  # enums keep their size with other values
            for p in t["function"]["parameters"]["properties"].values():
                assert not set(p.get("enum", [])) & USER_WORDS
        calls = calls_of(row)
        assert calls and all(name in offered for name, _ in calls)
        for name, arguments in calls:
            assert conformity(arguments, offered[name]) == [], (name, arguments)
            if shape(offered[name]) == shape(BOOK_HALL["function"]["parameters"]):
                optional_passed.add(list(offered[name]["properties"])[3] in arguments)  # encore_minutes' twin
        messages = row["messages"]
        assert messages[-1]["role"] == "assistant" and "\\boxed{" in messages[-1]["content"]
        if len(calls) == 2:  # a chain: the first tool's result is passed on to the second
            chains += 1
            result = messages[3]["content"].rsplit(" is ", 1)[1].rstrip(".")
            assert result in [str(v) for v in calls[1][1].values()]
    assert chains >= 4 and optional_passed == {True, False}


# Mistral Nemo's template moves the tools to the last user turn, so no SFT conversation with tools splits into
# turns there (offline/data.py refuses it, naming the message).
FAMILIES = ["demo", "qwen2.5", "llama3.1", "qwen3_coder"]


@pytest.fixture(scope="module")
def family_tokenizers(demo_model_dir, family_templates):
    """The demo vocabulary with each family's chat template ("demo": its own, which renders no tools, so the
    builtin tool prompt is used)."""
    from transformers import AutoTokenizer

    out = {"demo": AutoTokenizer.from_pretrained(demo_model_dir)}
    for family in FAMILIES[1:]:
        tok = AutoTokenizer.from_pretrained(demo_model_dir)
        tok.chat_template = family_templates[family]
        out[family] = tok
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_demonstrations_parse_back_with_the_family_tool_parser(family, family_tokenizers):
    """Each demonstrated call, rendered as the SFT renders it (the family's template, or the builtin tool prompt),
    is read back by the parser the rollouts use for that family: the same tool, the same arguments."""
    from astuner.model_tuner import ChatRenderer, detect_formats
    from astuner.model_tuner.formats import template_source
    from astuner.model_tuner.tool_parser import TOOL_PARSERS
    from astuner.offline.data import tokenize_conversation
    from astuner.tool_demos import demonstrations

    tokenizer = family_tokenizers[family]
    renderer = ChatRenderer(tokenizer, "auto")
    parser = TOOL_PARSERS[detect_formats(template_source(tokenizer), renderer.uses_builtin_tool_prompt).tool_parser]()
    ends = (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|eom_id|>")
    checked = 0
    for row in demonstrations(USER_TOOLS, count=8, seed=1):
        tools, messages = row["tools"], row["messages"]
        example = tokenize_conversation(renderer, messages, tools, ends)  # the SFT's own tokenization
        assert sum(example.mask) > 0
        for i, message in enumerate(messages):
            if not message.get("tool_calls"):
                continue
            before = renderer.render_text(messages[:i], tools)
            turn = renderer.render_text(messages[: i + 1], tools, add_generation_prompt=False)[len(before):]
            for end in ends:
                turn = turn.split(end)[0] if end and end in turn else turn
            parsed = parser.parse(turn, {t["function"]["name"] for t in tools})
            assert parsed.errors == [], (family, turn)
            expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
            assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected, (family, turn)
            checked += 1
    assert checked >= 8


@pytest.fixture
def lookup_task(monkeypatch):
    monkeypatch.syspath_prepend(str(TUTORIAL))
    import lookup_task

    yield lookup_task
    sys.modules.pop("lookup_task", None)


def test_dry_run_reads_the_tools_the_workflow_offers(tmp_path, tiny_model_dir, lookup_task):
    """The agent quick-start's OpenAI-SDK agent, two greedy episodes on the tiny model: the tools its requests
    offered are recorded on each call and come back exactly as the agent declared them."""
    from astuner.config import load_config
    from astuner.offline.warmstart import tools_from_dry_run

    loaded = load_config(TUTORIAL / "agent_quickstart.yaml", [
        f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf",
        "astuner.rollout.max_response_length_in_one_turn=8", "astuner.rollout.compute_madness_checklist=[]"])
    assert tools_from_dry_run(loaded, episodes=2) == lookup_task.TOOL_SCHEMAS


def test_warmstart_with_a_tools_file_trains_and_prints_the_checkpoint(tmp_path, tiny_model_dir, lookup_task,
                                                                       capsys):
    from astuner.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(USER_TOOLS))
    run = tmp_path / "run"
    code = main(["warmstart", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--tools", str(tools),
                 "--count", "4", "--epochs", "1", f"astuner.experiment_dir={run}",
                 f"astuner.model.path={tiny_model_dir}", "astuner.data.train_batch_size=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    folder = tmp_path / "run_warmstart"
    checkpoint = folder / "global_step_2"
    assert out.strip().splitlines()[-1] == f"astuner: warm start done: train from astuner.model.path={checkpoint}"
    assert (checkpoint / "config.json").is_file()
    rows = [json.loads(line) for line in (folder / "demonstrations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and not {n for r in rows for n, _ in calls_of(r)} & USER_WORDS
    assert json.loads((folder / "tools.json").read_text()) == USER_TOOLS
    trained = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in trained if "actor/sft_loss" in m]) == 2
    assert not run.exists()  # the GRPO run's folder stays for GRPO
