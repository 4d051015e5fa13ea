"""The user's tool schemas, checked and put in the one plain form the warm start's twins are made from.

Pydantic and the OpenAI Agents SDK write `Optional[X]` as `anyOf: [X, {"type": "null"}]`, enums and models as
`$ref`s into `$defs`, and `allOf: [{"$ref": ...}]` for a described model. `plain_parameters` resolves local refs,
merges `allOf`, reduces a union to its first non-null branch (null kept in `type`), and reads draft-4 boolean
`exclusiveMinimum`; what it cannot make a twin of (a remote or recursive ref, an empty range, a schema that is not
a dict) is a UserError naming the tool and the field. `check_tools` also returns notes on what the twins drop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from astuner.errors import UserError

# String formats the twins give values of (tool_demo_twins.FORMATS); others are dropped from the twin, with a note.
KNOWN_FORMATS = ("date", "date-time", "time", "email", "uri", "uuid")
_UNION = ("anyOf", "oneOf")
_FIX = ("give a JSON schema as OpenAI function calling takes it, or the tools with --tools FILE")


def function_of(tool: Any) -> dict:
    """The function part of an OpenAI tool schema ({"type": "function", "function": {...}} or the bare function)."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UserError(f"not an OpenAI function schema (no function name): {json.dumps(tool)[:200]}; {_FIX}")
    return function


def _fail(tool: str, where: str, what: str) -> UserError:
    return UserError(f"tool {tool!r}, {where}: {what}; {_FIX}")


def kind_of(schema: dict) -> str | None:
    """The JSON type a plain schema declares or implies (None: any)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kept = [k for k in kind if k != "null"]
        return kept[0] if kept else "null"
    if kind is not None:
        return str(kind)
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    if schema.get("enum"):
        return {bool: "boolean", int: "integer", float: "number"}.get(type(schema["enum"][0]), "string")
    return None


def _nullable(schema: dict, kind: str | None) -> dict:
    return {**schema, "type": [kind, "null"]} if kind and kind != "null" else schema


class _Plain:
    """Walks one tool's parameters: `defs` are its `$defs`/`definitions`, `notes` collects what twins drop."""

    def __init__(self, tool: str, parameters: dict) -> None:
        self.tool, self.notes = tool, []
        self.defs = {**(parameters.get("definitions") or {}), **(parameters.get("$defs") or {})}

    def resolve(self, schema: Any, where: str, seen: tuple = ()) -> dict:
        if schema is True or schema is None:
            return {}
        if not isinstance(schema, dict):
            raise _fail(self.tool, where, f"{json.dumps(schema)[:80]} is not a JSON schema object")
        if "$ref" in schema:
            ref = schema["$ref"]
            name = next((ref[len(p):] for p in ("#/$defs/", "#/definitions/") if str(ref).startswith(p)), None)
            if name is None or name not in self.defs:
                raise _fail(self.tool, where, f"$ref {ref!r} is not a local definition of the schema (#/$defs/NAME);"
                            " inline it")
            if name in seen:
                raise _fail(self.tool, where, f"$ref {ref!r} is recursive, which a twin cannot copy; give a "
                            "schema of bounded depth")
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self.resolve({**self.defs[name], **rest}, where, (*seen, name))
        schema = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"] or []:
                part = self.resolve(part, where, seen)
                properties = {**part.get("properties", {}), **merged.get("properties", {})}
                required = [*part.get("required", []), *merged.get("required", [])]
                merged = {**part, **merged, "properties": properties, "required": required}
            schema = {k: v for k, v in merged.items() if v or k not in ("properties", "required")}
        for key in _UNION:
            if key in schema:
                branches = [self.resolve(b, f"{where} ({key})", seen) for b in schema[key] or []]
                kept = [b for b in branches if kind_of(b) != "null"]
                outer = {k: v for k, v in schema.items() if k not in _UNION}
                chosen = {**outer, **kept[0]} if kept else {**outer, "type": "null"}
                return _nullable(chosen, kind_of(chosen)) if len(kept) < len(branches) else chosen
        if isinstance(schema.get("enum"), list) and None in schema["enum"]:  # {"enum": [null, "a"]}: nullable
            values = [v for v in schema["enum"] if v is not None]
            schema = {**schema, "enum": values} if values else {k: v for k, v in schema.items() if k != "enum"}
            schema = _nullable(schema, kind_of(schema) or "string")
        return self.check(schema, where, seen)

    def check(self, schema: dict, where: str, seen: tuple) -> dict:
        """Bounds that a value can meet, sub-schemas made plain."""
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise _fail(self.tool, where, "enum must be a non-empty list of values")
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            flag = schema.get(key)
            if isinstance(flag, bool):  # draft 4: a flag on minimum/maximum
                schema = {k: v for k, v in schema.items() if k != key}
                if flag and bound in schema:
                    schema[key] = schema.pop(bound)
        for low, high in (("minimum", "maximum"), ("minItems", "maxItems"), ("minLength", "maxLength")):
            if low in schema and high in schema and schema[low] > schema[high]:
                raise _fail(self.tool, where, f"{low} {schema[low]} is above {high} {schema[high]}: no value fits")
        kind = kind_of(schema)
        if kind == "integer":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", float("-inf")) + 1)
            hi = schema.get("maximum", schema.get("exclusiveMaximum", float("inf")) - 1)
            if lo > hi:
                raise _fail(self.tool, where, "its bounds leave no integer")
        if kind == "string" and schema.get("format") and schema["format"] not in KNOWN_FORMATS:
            self.notes.append(f"tool {self.tool!r}, {where}: format {schema['format']!r} is not generated; its "
                              "twin is a plain string")
        if "properties" in schema:
            if not isinstance(schema["properties"], dict):
                raise _fail(self.tool, where, "properties must be an object of argument schemas")
            required = schema.get("required") or []
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise _fail(self.tool, where, "required must be a list of argument names")
            schema = {**schema, "properties": {name: self.resolve(sub, f"{where}.{name}", seen)
                                               for name, sub in schema["properties"].items()}}
        if "items" in schema:
            items = schema["items"]
            items = items[0] if isinstance(items, list) and items else items  # tuple form: its first item's shape
            schema = {**schema, "items": self.resolve(items, f"{where}[]", seen)}
        return schema


def plain_parameters(tool: Any) -> tuple[dict, list[str]]:
    """(the tool's parameters in plain form, notes on what a twin drops); a UserError for what it cannot twin."""
    function = function_of(tool)
    name = function["name"]
    parameters = function.get("parameters")
    if parameters is None:
        return {"type": "object", "properties": {}}, []
    if not isinstance(parameters, dict):
        raise _fail(name, "parameters", f"{json.dumps(parameters)[:80]} is not a JSON schema object")
    walker = _Plain(name, parameters)
    plain = walker.resolve(parameters, "parameters")
    if kind_of(plain) not in ("object", None):
        raise _fail(name, "parameters", f"type {plain.get('type')!r}: the parameters of a function are an object")
    return plain, walker.notes


def check_tools(tools: list) -> list[str]:
    """Every tool made plain (a UserError naming the tool and field for what cannot be); the notes of all."""
    notes: list[str] = []
    for tool in tools:
        plain, dropped = plain_parameters(tool)
        notes += dropped + quoted_examples(function_of(tool), plain)
    return notes


# A quoted value in a description ('e.g. "umbrella"', "like 'EUR'"): a small warm-started model copies it into
# every call, whatever the task asks.
_QUOTED = re.compile(r"""(?:^|[\s(:=,])(["'`\u201c])([^"'`\u201d\n]{1,40})(?:["'`\u201d])""")


def quoted_examples(function: dict, plain: dict) -> list[str]:
    """A note for each description (the tool's, or an argument's) that holds a quoted example value."""
    described = [("", function.get("description"))]
    described += [(f", argument {name!r}", (schema or {}).get("description"))
                  for name, schema in (plain.get("properties") or {}).items() if isinstance(schema, dict)]
    notes = []
    for where, text in described:
        found = _QUOTED.search(text) if isinstance(text, str) else None
        if found:
            notes.append(f"tool {function['name']!r}{where}: its description quotes an example value "
                         f"({found.group(1)}{found.group(2)}{found.group(1)}); a small warm-started model tends to "
                         "copy such a value into every call: describe the values without one (\"an item name\")")
    return notes
