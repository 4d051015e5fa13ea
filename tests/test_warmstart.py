"""`astuner warmstart`: demonstrations with made-up twins of the agent's tools (astuner/offline/tool_demos.py),
read back by each family's tool parser through the SFT's own rendering, the tools read from a dry run of the agent
quick-start's workflow, and the command end to end on the tiny model."""

from __future__ import annotations

import json
import re
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
    from astuner.offline.tool_demos import demonstrations

    rows = demonstrations(USER_TOOLS, count=24, seed=3)
    assert len(rows) == 24
    assert rows == demonstrations(USER_TOOLS, count=24, seed=3)  # pure and seeded
    assert rows != demonstrations(USER_TOOLS, count=24, seed=4)
    chains = identifiers = 0
    optional_passed = set()
    for row in rows:
        text = json.dumps(row).lower()
        assert not [w for w in USER_WORDS if f'"{w}"' in text or f" {w} " in text], text
        assert not [d for d in USER_DESCRIPTIONS if d.lower() in text]
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
        # Every offered tool is a twin of one of the user's; a single call is offered its tool alone, a chain its
        # two (the identifier it carries reshapes nothing: a string stays a string).
        shapes = [shape(p) for p in offered.values()]
        assert all(s in [shape(t["function"]["parameters"]) for t in USER_TOOLS] for s in shapes)
        assert len(offered) == len(calls_of(row))
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
            name, passed = calls[1][0], next(k for k, v in calls[1][1].items() if str(v) == result)
            if "enum" not in offered[name]["properties"][passed] and isinstance(calls[1][1][passed], str):
                identifiers += 1  # a string carried is an identifier: four digits or LL999
                assert re.fullmatch(r"\d{4}|[A-Z]{2}\d{3}", result), result
    assert chains >= 4 and identifiers >= 2 and optional_passed == {True, False}


def test_no_name_or_description_of_the_demonstrations_says_a_word_of_the_users_tool_names(lookup_task):
    """The agent quick-start's tools (find_badge, lookup_code): no twin gives a "badge colour" or a "voucher code",
    nor uses their verbs."""
    from astuner.offline.tool_demos import demonstrations

    said, bare = set(), 0
    rows = demonstrations(lookup_task.TOOL_SCHEMAS, count=64, seed=0)
    for row in rows:
        for tool in row["tools"]:
            function = tool["function"]
            said |= set(re.split(r"[^a-z0-9]+", f"{function['name']} {function['description']}".lower()))
            said |= {w for name in function["parameters"]["properties"] for w in name.split("_")}
        # One value asked for: about half the questions give it bare ("the tide level for Mars"), so the
        # argument's name is read from the schema, not copied from the question.
        called = next(t for t in row["tools"] if t["function"]["name"] == calls_of(row)[0][0])
        first_argument = next(iter(called["function"]["parameters"]["properties"].values()))
        words = first_argument["description"].removeprefix("The ").rstrip(".")
        bare += f" {words} " not in row["messages"][1]["content"]
    assert not said & {"find", "badge", "lookup", "code"}, said & {"find", "badge", "lookup", "code"}
    assert len(rows) // 4 < bare < len(rows) * 3 // 4, bare


def test_chains_are_half_with_several_tools_none_with_one_and_the_share_is_checked():
    from astuner.offline.tool_demos import demonstrations

    chains = lambda rows: sum(len(calls_of(r)) == 2 for r in rows)  # noqa: E731
    assert chains(demonstrations(USER_TOOLS, count=32, seed=0)) == 16
    assert chains(demonstrations([BOOK_HALL], count=32, seed=0)) == 0
    assert chains(demonstrations([BOOK_HALL], count=32, seed=0, chain_share=0.25)) == 8
    with pytest.raises(ValueError, match="between 0 and 1"):
        demonstrations(USER_TOOLS, chain_share=1.5)


# Mistral Nemo's template moves the tools to the last user turn, so no SFT conversation with tools splits into
# turns there (task_reader/offline_data.py refuses it, naming the message).
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
@pytest.mark.slow
def test_demonstrations_parse_back_with_the_family_tool_parser(family, family_tokenizers):
    """Each demonstrated call, rendered as the SFT renders it (the family's template, or the builtin tool prompt),
    is read back by the parser the rollouts use for that family: the same tool, the same arguments."""
    from astuner.model_tuner import ChatRenderer, detect_formats
    from astuner.model_tuner.formats import template_source
    from astuner.model_tuner.tool_parser import TOOL_PARSERS
    from astuner.task_reader.offline_data import tokenize_conversation
    from astuner.offline.tool_demos import demonstrations

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
            parsed = parser.parse(turn, {t["function"]["name"] for t in tools}, tools=tools)
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


@pytest.mark.slow
def test_dry_run_reads_the_tools_the_workflow_offers(tmp_path, tiny_model_dir, lookup_task):
    """The agent quick-start's OpenAI-SDK agent, two greedy episodes on the tiny model: the tools its requests
    offered are recorded on each call and come back exactly as the agent declared them."""
    from astuner.config import load_config
    from astuner.offline.warmstart import tools_from_dry_run

    loaded = load_config(TUTORIAL / "agent_quickstart.yaml", [
        f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf",
        "astuner.rollout.max_response_length_in_one_turn=8", "astuner.rollout.compute_madness_checklist=[]"])
    tools, results = tools_from_dry_run(loaded, episodes=2)
    assert tools == lookup_task.TOOL_SCHEMAS and all(isinstance(r, str) for r in results)


@pytest.mark.slow
def test_warmstart_with_a_tools_file_trains_and_prints_the_checkpoint(tmp_path, tiny_model_dir, lookup_task,
                                                                       capsys):
    from astuner.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(USER_TOOLS))
    run = tmp_path / "run"
    small = ["astuner.data.train_batch_size=2", "astuner.rollout.engine=hf",
             "astuner.rollout.max_response_length_in_one_turn=8"]
    code = main(["warmstart", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--tools", str(tools),
                 "--count", "4", "--epochs", "1", "--draws", "2", f"astuner.experiment_dir={run}",
                 f"astuner.model.path={tiny_model_dir}", *small])
    out, err = capsys.readouterr()
    assert code == 0, err
    # A random model scores no episode: the check draws once more (seed 1, draw_2/), then says so; the last draw
    # is kept, linked as <folder>/model, the path the command names.
    warm = tmp_path / "run_warmstart"
    first, folder = warm / "draw_1", warm / "draw_2"
    checkpoint = folder / "global_step_2"
    assert out.strip().splitlines()[-1] == (f"astuner --conf {TUTORIAL / 'agent_quickstart.yaml'} "
                                            f"{' '.join(small)} astuner.model.path={warm / 'model'} "
                                            f"astuner.experiment_dir={tmp_path / 'run_from_warmstart'}")
    assert (checkpoint / "config.json").is_file() and (first / "global_step_2" / "config.json").is_file()
    assert (warm / "model").resolve() == checkpoint.resolve() and not (warm / "model").readlink().is_absolute()
    assert sorted(p.name for p in warm.iterdir()) == ["draw_1", "draw_2", "model"]
    assert "0 of 32 sampled episodes on 8 training task(s) scored" in err and "tool calls per episode" in err
    assert "drawing other demonstrations (seed 1)" in err and "no draw of 2 scored" in err
    assert "with --seed 2" in err  # what to do when GRPO then finds no reward
    rows = [json.loads(line) for line in (folder / "demonstrations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and not {n for r in rows for n, _ in calls_of(r)} & USER_WORDS
    assert rows != [json.loads(line) for line in (first / "demonstrations.jsonl").read_text().splitlines()]
    assert json.loads((folder / "tools.json").read_text()) == USER_TOOLS
    trained = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in trained if "actor/sft_loss" in m]) == 2
    assert not run.exists()  # the GRPO run's folder stays for GRPO


def test_the_draw_check_counts_what_grpo_can_learn_from():
    from types import SimpleNamespace as NS

    from astuner.offline.warmstart import draw_check

    def episodes(*groups):
        return [NS(task=NS(task_id=f"t{i}"), reward=r, is_success=r == 1.0, calls=[], flags=[])
                for i, g in enumerate(groups) for r in g]

    stuck = draw_check(episodes([0.0, 0.0], [0.0, 0.0]))
    assert (stuck.scored, stuck.signal_tasks, stuck.tasks, stuck.stuck) == (0, 0, 2, True)
    # A format credit paid to every episode is no signal either.
    assert draw_check(episodes([0.3, 0.3], [0.3, 0.3])).stuck
    mixed = draw_check(episodes([0.0, 1.0], [0.0, 0.0]))
    assert (mixed.scored, mixed.signal_tasks, mixed.stuck) == (1, 1, False)
    solved = draw_check(episodes([1.0, 1.0]))  # nothing to compare, but nothing to fix by drawing again
    assert (solved.scored, solved.signal_tasks, solved.stuck) == (2, 0, False)


def test_the_draw_check_says_what_the_model_did_and_when_it_measured_nothing():
    from astuner.offline.warmstart import draw_check
    from astuner.types import Episode, LLMCall, Task

    def episode(i, calls, flags=()):
        stock = {"type": "function", "function": {"name": "stock", "arguments": '{"item": "scarf"}'}}
        reply = {"tool_calls": [stock] * calls} if calls else {"content": "no idea"}
        return Episode(Task(f"t{i % 2}", "q"), i, f"e{i}", calls=[LLMCall([1], [2], [-1.0], "stop", 1.0, reply=reply)],
                       flags=list(flags), error_summary="episode timed out after 60s" if flags else None)

    check = draw_check([episode(0, 3), episode(1, 0), episode(2, 1), episode(3, 0)])
    assert check.void is None and check.line() == (
        "0 of 4 sampled episodes on 2 training task(s) scored; 0 task(s) give GRPO rewards to compare; 1.00 tool "
        "calls per episode, 2 of 4 episodes with one")
    assert check.example == "task t0, reward 0: " + " -> ".join(['stock({"item": "scarf"})'] * 3 + ["''"])
    assert draw_check([episode(1, 0)]).example == "task t1, reward 0: 'no idea'"
    void = draw_check([episode(i, 1, ["timeout"]) for i in range(3)] + [episode(3, 0)])
    assert void.line() == ("the check is void: 3 of 4 timed out (episode timed out after 60s; "
                           "astuner.rollout.episode_timeout); its score is n/a (0.75 tool calls per episode, 3 of 4 "
                           "episodes with one)")


@pytest.mark.slow
def test_a_draw_whose_episodes_score_is_kept(tmp_path, tiny_model_dir, lookup_task, monkeypatch, capsys):
    from astuner.cli import main
    from astuner.offline import warmstart

    checks = iter([warmstart.DrawCheck(32, 0, 0, 8), warmstart.DrawCheck(32, 5, 3, 8), warmstart.DrawCheck(32, 5, 3, 8)])
    monkeypatch.setattr(warmstart, "check_warm_start", lambda loaded, checkpoint, settings: next(checks))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(USER_TOOLS))
    code = main(["warmstart", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--tools", str(tools),
                 "--count", "4", "--epochs", "1", "--seed", "5", f"astuner.experiment_dir={tmp_path / 'run'}",
                 f"astuner.model.path={tiny_model_dir}", "astuner.data.train_batch_size=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "draw 2 of at most 3 (seed 6)" in err and "draw 3" not in err and "WARNING" not in err
    warm = tmp_path / "run_warmstart"
    assert f"astuner.model.path={warm / 'model'}" in out.splitlines()[-1]
    assert (warm / "model").resolve() == (warm / "draw_2" / "global_step_2").resolve()
    # Run again: the folder is not empty, so the next warm start writes beside it, never into it.
    code = main(["warmstart", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--tools", str(tools),
                 "--count", "4", "--epochs", "1", "--draws", "1", f"astuner.experiment_dir={tmp_path / 'run'}",
                 f"astuner.model.path={tiny_model_dir}", "astuner.data.train_batch_size=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"astuner.model.path={tmp_path / 'run_warmstart_1' / 'model'}" in out.splitlines()[-1]
    assert (warm / "model").resolve() == (warm / "draw_2" / "global_step_2").resolve()


@pytest.mark.slow
def test_a_rerun_reuses_the_dry_run_of_the_same_agent_and_reads_again_when_it_changed(tmp_path, tiny_model_dir,
                                                                                      monkeypatch, capsys):
    """The dry run's tools are saved with the agent's fingerprint (its workflow's folder of .py files and the
    rollout settings); a rerun beside it reuses them, and runs the dry run again when the code or the rollout
    changed, or when asked to."""
    import shutil

    from astuner.cli import main
    from astuner.offline import warmstart

    agent = tmp_path / "agent"
    shutil.copytree(TUTORIAL, agent)
    dry_runs = []

    def dry_run(loaded, episodes):
        dry_runs.append(episodes)
        return USER_TOOLS, ["The badge is 4411."]

    def sft(conf, keys, folder):
        (folder / "global_step_1").mkdir(parents=True)
        return folder / "global_step_1"

    monkeypatch.setattr(warmstart, "tools_from_dry_run", dry_run)
    monkeypatch.setattr(warmstart, "_sft", sft)
    monkeypatch.setattr(warmstart, "check_warm_start", lambda loaded, checkpoint, settings:
                        warmstart.DrawCheck(32, 5, 3, 8))

    def rerun(*extra: str) -> str:
        code = main(["warmstart", "--conf", str(agent / "agent_quickstart.yaml"), "--count", "4",
                     f"astuner.experiment_dir={tmp_path / 'run'}", f"astuner.model.path={tiny_model_dir}", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        return err

    first = rerun()
    assert len(dry_runs) == 1 and "dry run of 4 episode(s)" in first
    saved = json.loads((tmp_path / "run_warmstart" / "dry_run.json").read_text())
    assert saved["tools"] == USER_TOOLS and saved["results"] == ["The badge is 4411."]
    again = rerun()
    assert len(dry_runs) == 1, again
    assert f"the tools of the dry run in {tmp_path / 'run_warmstart'} (the agent's code" in again
    assert json.loads((tmp_path / "run_warmstart_1" / "dry_run.json").read_text()) == saved
    assert json.loads((tmp_path / "run_warmstart_1" / "draw_1" / "tools.json").read_text()) == USER_TOOLS
    rerun("--fresh-dry-run")
    assert len(dry_runs) == 2
    rerun("astuner.rollout.max_env_worker=3")  # another rollout setting: read again
    assert len(dry_runs) == 3
    rerun("astuner.rollout.max_env_worker=3")
    assert len(dry_runs) == 3
    with (agent / "lookup_task.py").open("a") as f:  # a module beside the workflow changed: read again
        f.write("\n# the tools may have changed\n")
    rerun("astuner.rollout.max_env_worker=3")
    assert len(dry_runs) == 4


def _tool(name: str, parameters, description: str = "d") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# How pydantic (and the OpenAI Agents SDK) write Optional[Model], Optional[Enum], Optional[list[int]] and models or
# enums by reference.
PYDANTIC_STYLE = _tool("plan_trip", {
    "type": "object",
    "$defs": {"Mode": {"type": "string", "enum": ["rail", "coach", "ferry"], "title": "Mode"},
              "Party": {"type": "object", "properties": {"adults": {"type": "integer", "minimum": 1},
                                                          "note": {"type": "string"}}, "required": ["adults"]}},
    "properties": {
        "mode": {"$ref": "#/$defs/Mode"},
        "party": {"$ref": "#/$defs/Party"},
        "backup": {"anyOf": [{"$ref": "#/$defs/Party"}, {"type": "null"}], "default": None},
        "alt_mode": {"anyOf": [{"$ref": "#/$defs/Mode"}, {"type": "null"}]},
        "legs": {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 200}},
                           {"type": "null"}]}},
    "required": ["mode", "party", "backup", "alt_mode", "legs"]})


def test_twins_of_refs_and_optionals_keep_the_branch_shape_and_nullability():
    from astuner.offline.tool_demos import demonstrations

    for row in demonstrations([PYDANTIC_STYLE], count=8, seed=0):
        twin = row["tools"][0]["function"]["parameters"]
        mode, party, backup, alt_mode, legs = twin["properties"].values()  # in the user's order
        assert mode["type"] == "string" and len(mode["enum"]) == 3
        assert party["type"] == "object" and len(party["properties"]) == 2 and len(party["required"]) == 1
        assert backup["type"] == ["object", "null"] and len(backup["properties"]) == 2
        assert alt_mode["type"] == ["string", "null"] and len([v for v in alt_mode["enum"] if v]) == 3
        assert None in alt_mode["enum"]
        assert legs["type"] == ["array", "null"]
        assert legs["items"] == {"type": "integer", "minimum": 100, "maximum": 200}
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
        for name, arguments in calls_of(row):
            assert conformity(arguments, offered[name]) == [], (name, arguments)


@pytest.mark.parametrize("parameters, field", [
    ({"type": "object", "properties": {"x": {"$ref": "https://example.org/schema.json"}}}, "parameters.x"),
    ({"type": "object", "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
      "properties": {"head": {"$ref": "#/$defs/Node"}}}, "parameters.head.next"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}, "parameters.x"),
    ("oops", "parameters"),
    ({"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}}, "parameters.x"),
    ({"type": "object", "properties": {"xs": {"type": "array", "minItems": 5, "maxItems": 2}}}, "parameters.xs"),
])
def test_a_schema_the_twins_cannot_copy_stops_naming_the_tool_and_field(tmp_path, parameters, field):
    from astuner.errors import UserError
    from astuner.offline.warmstart import read_tools_file

    path = tmp_path / "tools.json"
    path.write_text(json.dumps([_tool("odd_tool", parameters)]))
    with pytest.raises(UserError, match=f"tool 'odd_tool', {field.replace('.', '[.]')}:"):
        read_tools_file(path)


def test_a_malformed_tools_file_exits_2_with_a_message(tmp_path, capsys):
    from astuner.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([_tool("bad", "oops")]))
    code = main(["warmstart", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--tools", str(tools),
                 f"astuner.experiment_dir={tmp_path / 'run'}"])
    assert code == 2 and "tool 'bad', parameters:" in capsys.readouterr().err


BOUNDS = [
    _tool("dive", {"type": "object", "properties": {"depth": {"type": "integer", "maximum": -5}}, "required": ["depth"]}),
    _tool("big", {"type": "object", "properties": {"x": {"type": "number", "minimum": 1e6}}, "required": ["x"]}),
    _tool("when", {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                     "code": {"type": "string", "maxLength": 3, "minLength": 2}},
                   "required": ["day", "code"]}),
    _tool("excl", {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "exclusiveMinimum": True,
                                                          "maximum": 2}}, "required": ["k"]}),
]


def test_demonstrated_values_meet_the_users_bounds_formats_and_lengths():
    import re

    from astuner.offline.tool_demos import demonstrations

    seen, formats = 0, set()
    for tool in BOUNDS:
        for row in demonstrations([tool], count=8, seed=2):
            offered = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
            for tool_name, arguments in calls_of(row):
                twin = offered[tool_name]
                assert conformity(arguments, twin) == []
                for name, value in arguments.items():
                    schema = twin["properties"][name]
                    if "exclusiveMinimum" in schema:
                        assert value > schema["exclusiveMinimum"]
                    formats.add(schema.get("format"))
                    if schema.get("format") == "date":
                        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", value)
                    assert schema.get("minLength", 0) <= len(str(value)) <= schema.get("maxLength", 99)
                    seen += 1
    assert seen >= 40 and "date" in formats  # the user's format is kept, and met


def test_no_word_of_the_users_tools_is_a_demonstrated_value():
    from astuner.offline.tool_demos import demonstrations

    tool = _tool("travel", {"type": "object", "properties": {
        "dest": {"type": "string", "enum": ["Lisbon", "Osaka", "Quito"]},
        "note": {"type": "string", "description": "A note, e.g. Tallinn or Accra."},
        "by": {"type": "string"}}, "required": ["dest", "note", "by"]}, description="Travel to Dakar or Hobart.")
    words = {"lisbon", "osaka", "quito", "tallinn", "accra", "dakar", "hobart"}
    for row in demonstrations([tool], count=64, seed=0):
        for _, arguments in calls_of(row):
            assert not {str(v).lower() for v in arguments.values()} & words, arguments


def test_the_next_command_trains_in_a_folder_of_its_own(tmp_path, monkeypatch):
    from astuner.offline.warmstart import grpo_command, grpo_folder

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "launcher_record" / "my_agent"
    assert grpo_folder(run) == run.with_name("my_agent_from_warmstart")
    (run.with_name("my_agent_from_warmstart") / "global_step_2").mkdir(parents=True)  # an earlier one's run
    assert grpo_folder(run) == run.with_name("my_agent_from_warmstart_1")
    command = grpo_command("my_agent.yaml", ["astuner.rollout.n=4", "astuner.model.path=base",
                                             f"astuner.experiment_dir={run}"],
                           grpo_folder(run), tmp_path / "ck" / "global_step_16")
    assert command == ("astuner --conf my_agent.yaml astuner.rollout.n=4 "
                       "astuner.model.path=ck/global_step_16 "
                       "astuner.experiment_dir=launcher_record/my_agent_from_warmstart_1")


def test_a_quoted_example_in_a_description_is_named():
    """A warm-started small model copied `e.g. "umbrella"` into every call: the tools' check says so."""
    from astuner.offline.tool_schema import check_tools

    def tool(description, item_description):
        return {"type": "function", "function": {"name": "stock", "description": description, "parameters": {
            "type": "object", "properties": {"item": {"type": "string", "description": item_description}}}}}

    notes = check_tools([tool("How many of an item are in stock.", 'The item, e.g. "umbrella".')])
    assert notes == ["tool 'stock', argument 'item': its description quotes an example value (\"umbrella\"); a small "
                     "warm-started model tends to copy such a value into every call: describe the values without one "
                     "(\"an item name\")"]
    assert "tool 'stock': its description quotes an example value ('EUR')" in check_tools(
        [tool("Prices in a currency such as 'EUR'.", "The item.")])[0]
    assert check_tools([tool("The shop's stock (don't guess).", "The item's name, as the customer wrote it.")]) == []


SHOP_TOOLS = [
    {"type": "function", "function": {"name": "stock", "description": "How many of an item the shop has.",
                                      "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                                     "required": ["item"]}}},
    {"type": "function", "function": {"name": "price", "description": "The price of one item in a currency.",
                                      "parameters": {"type": "object", "properties": {
                                          "item": {"type": "string"},
                                          "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]}},
                                          "required": ["item", "currency"]}}},
]


def test_gather_episodes_call_two_tools_and_compute_the_answer_from_their_numbers():
    """The shop assistant's pattern: two independent look-ups, a product or a sum written out, then the box."""
    import re

    from astuner.offline.tool_demos import demonstrations

    rows = demonstrations(SHOP_TOOLS, count=40, seed=3, chain_share=0.0, gather_share=1.0)
    ops, wordings = set(), set()
    for row in rows:
        messages = row["messages"]
        calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
        offered = [t["function"]["name"] for t in row["tools"]]
        assert len(calls) == 2 and calls[0] != calls[1] and set(calls) <= set(offered)
        results = [m["content"] for m in messages if m["role"] == "tool"]
        a, b = (float(re.search(r"-?\d+(?:\.\d+)?", text).group(0)) for text in results)
        wordings.update("bare" if re.fullmatch(r"-?\d+(?:\.\d+)?", text) else "is" if " is " in text else
                        "colon" if ": " in text else "brackets" for text in results)
        final = messages[-1]["content"]
        left, sign, right, result, boxed = re.match(
            r"(-?[\d.]+) ([*+]) (-?[\d.]+) = (-?[\d.]+)\. The answer is \\boxed\{(-?[\d.]+)\}\.$", final).groups()
        assert (float(left), float(right)) == (a, b) and result == boxed
        assert float(result) == pytest.approx(a * b if sign == "*" else a + b, abs=1e-9)
        assert ("times" if sign == "*" else "plus") in messages[1]["content"]
        ops.add(sign)
        text = json.dumps(row).lower()
        assert not re.search(r"\b(stock|price|item|currency|eur|usd|gbp)\b", text), text  # none of the user's words
    assert ops == {"*", "+"}
    assert wordings == {"bare", "is", "colon", "brackets"}  # results worded every way a tool may
    # The shares add up: 8 chains, 16 gathers, 8 singles of 32.
    mixed = demonstrations(SHOP_TOOLS, count=32, seed=0, chain_share=0.25, gather_share=0.5)
    kinds = [sum(bool(m.get("tool_calls")) for m in r["messages"]) if "=" not in r["messages"][-1]["content"]
             else "gather" for r in mixed]
    assert (kinds.count("gather"), kinds.count(2), kinds.count(1)) == (16, 8, 8)
    with pytest.raises(ValueError, match="add up to more"):
        demonstrations(SHOP_TOOLS, chain_share=0.6, gather_share=0.5)


def test_gather_twins_share_the_argument_the_users_tools_share():
    """stock(item) and price(item, currency) look up the same item: the twins share that argument, both calls
    pass the question's one value, and the question says it once. Tools that name nothing alike share nothing."""
    import copy

    from astuner.offline.tool_demos import demonstrations, shared_arguments

    assert shared_arguments(SHOP_TOOLS[0]["function"], SHOP_TOOLS[1]["function"]) == [(0, 0)]
    questions = []
    for row in demonstrations(SHOP_TOOLS, count=24, seed=5, chain_share=0.0, gather_share=1.0):
        calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in row["messages"]
                 if m.get("tool_calls")]
        common = set(calls[0]) & set(calls[1])
        assert len(common) == 1 and set(calls[0]) < set(calls[1]), calls  # the smaller call first, then it grows
        (name,) = common
        assert calls[0][name] == calls[1][name]
        assert row["messages"][1]["content"].count(str(calls[0][name])) == 1  # given once
        schemas = [t["function"]["parameters"]["properties"] for t in row["tools"]]
        assert schemas[0][name] == schemas[1][name]
        values = [str(v) for v in {**calls[0], **calls[1]}.values()]
        questions.append(row["messages"][1]["content"])
        if " for the " not in questions[-1]:  # the values alone, as a shop's question gives them
            assert questions[-1].endswith(f" for {values[0]} and {values[1]}?"), questions[-1]
    bare = sum(" for the " not in q for q in questions)
    assert 4 <= bare <= 20, questions  # both forms, about half each
    apart = copy.deepcopy(SHOP_TOOLS)
    apart[1]["function"]["parameters"]["properties"]["product"] = apart[1]["function"]["parameters"][
        "properties"].pop("item")
    apart[1]["function"]["parameters"]["required"] = ["product", "currency"]
    assert shared_arguments(apart[0]["function"], apart[1]["function"]) == []
    for row in demonstrations(apart, count=12, seed=5, chain_share=0.0, gather_share=1.0):
        calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in row["messages"]
                 if m.get("tool_calls")]
        assert not set(calls[0]) & set(calls[1])


def test_twins_write_their_schemas_in_the_users_key_order():
    """AgentScope writes {"name", "parameters", "description"} and arguments as {"description", "type"}; the twins
    are written the same way at every level (a small model read the other order as a cue to copy the schema)."""
    from astuner.offline.tool_demos import demonstrations

    def agentscope(tool):
        f = tool["function"]
        parameters = {"properties": {n: {"description": "d", **{k: v for k, v in sub.items()}}
                                     for n, sub in f["parameters"]["properties"].items()},
                      "required": f["parameters"]["required"], "type": "object"}
        return {"type": "function", "function": {"name": f["name"], "parameters": parameters, "description": "d"}}

    def keys(tool):
        f = tool["function"]
        return (list(tool), list(f), list(f["parameters"]), [list(sub) for sub in f["parameters"]["properties"].values()])

    users = [agentscope(t) for t in SHOP_TOOLS]
    assert keys(users[1])[3] == [["description", "type"], ["description", "type", "enum"]]
    for row in demonstrations(users, count=16, seed=2):
        for tool in row["tools"]:
            like = users[1] if len(tool["function"]["parameters"]["properties"]) == 2 else users[0]
            assert keys(tool) == keys(like), tool
    for row in demonstrations(SHOP_TOOLS, count=8, seed=2):  # the OpenAI order stays the OpenAI order
        assert [list(t["function"]) for t in row["tools"]][0] == ["name", "description", "parameters"]


def test_gather_episodes_are_chosen_when_the_answers_look_computed():
    from astuner.offline.warmstart import WarmStartSettings, episode_kinds
    from astuner.offline.tool_demos import answers_are_computed

    assert answers_are_computed(["42", "17.5", "9"], [], SHOP_TOOLS)  # numbers; no tool result seen
    assert not answers_are_computed(["42", "17.5"], ["stock: 42", "17.5 EUR"], SHOP_TOOLS)  # read from a result
    assert answers_are_computed(["42", "17.5", "12"], ["stock: 6", "price: 7.0 EUR", "12"], SHOP_TOOLS)
    assert not answers_are_computed(["2500", "120"], [], SHOP_TOOLS[:1])  # one tool's number is read, not computed
    assert not answers_are_computed(["AB-1234", "CD-5678", "7"], [], SHOP_TOOLS)  # codes
    chosen, line = episode_kinds(WarmStartSettings(), SHOP_TOOLS, ["42", "17.5"], [])
    assert (chosen.gather_share, chosen.chain_share) == (1.0, 0.0)  # no demonstration boxes a result as it reads
    assert line.startswith("most of the judge's answers are numbers, and the dry run saw no tool result: 100% of")
    chained, _ = episode_kinds(WarmStartSettings(chain_share=0.25), SHOP_TOOLS, ["42", "17.5"], [])
    assert (chained.gather_share, chained.chain_share) == (0.75, 0.25)
    kept, line = episode_kinds(WarmStartSettings(), SHOP_TOOLS, ["AB-1234"], [])
    assert (kept.gather_share, kept.chain_share, line) == (0.0, None, None)
    given, _ = episode_kinds(WarmStartSettings(gather_share=0.1), SHOP_TOOLS, ["42"], [])
    assert given.gather_share == 0.1
