"""The made-up tools of the warm-start demonstrations (`tool_demos.py`): twins of the user's tools.

A twin of a tool keeps, argument by argument, the JSON type, whether it is required, enum-ness (with other values,
as many), nested objects and arrays (recursively), and numeric bounds; its names, descriptions and values come from
the vocabulary below, never from the user's schema (`user_vocabulary`: no drawn name or value shares a word with
it). `make_twin` draws one; `tool_demos.py` draws values for it and writes the episodes.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

from astuner.offline.tool_schema import function_of, kind_of, plain_parameters

# Each pool: (argument name, how a question says it, values). Names and words are the vocabulary of the twins.
STRINGS = [
    ("city", "city", ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hobart", "Bergen", "Cusco", "Dakar"]),
    ("colour", "colour", ["teal", "amber", "crimson", "ivory", "olive", "indigo", "coral", "slate"]),
    ("artist", "artist", ["Frida Lund", "Tomas Berg", "Ana Ruiz", "Kenji Mori", "Lea Vogel", "Omar Nasser"]),
    ("ingredient", "ingredient", ["saffron", "lentils", "ginger", "barley", "fennel", "paprika", "quinoa"]),
    ("planet", "planet", ["Mercury", "Venus", "Mars", "Jupiter", "Saturn", "Neptune", "Uranus"]),
    ("language", "language", ["Welsh", "Basque", "Tagalog", "Finnish", "Swahili", "Icelandic", "Malay"]),
    ("garment", "garment", ["raincoat", "cardigan", "kimono", "poncho", "waistcoat", "parka"]),
    ("bird", "bird", ["heron", "puffin", "kestrel", "magpie", "wren", "albatross", "toucan"]),
    ("instrument", "instrument", ["cello", "oboe", "sitar", "banjo", "marimba", "harp", "tuba"]),
    ("mineral", "mineral", ["quartz", "mica", "garnet", "feldspar", "jade", "topaz", "basalt"]),
    ("street", "street", ["Elm Row", "Dock Lane", "Mill Road", "Quay Street", "Hill Walk", "Park Crescent"]),
    ("station", "station", ["Northgate", "Riverside", "Old Market", "Harbour", "Westfield", "Kingsbridge"]),
]
# Strings of a `format` (tool_schema.KNOWN_FORMATS): values that meet it, under names that say it.
FORMATS = {
    "date": [("day", "day", ["2021-03-14", "2019-11-02", "2023-06-30", "2020-01-17", "2022-09-08"]),
             ("start_date", "start date", ["2018-05-21", "2024-02-29", "2017-12-01", "2021-07-04"])],
    "date-time": [("moment", "moment", ["2021-03-14T09:30:00Z", "2019-11-02T17:05:00Z", "2023-06-30T06:45:00Z"])],
    "time": [("clock_time", "time", ["09:30:00", "17:05:00", "06:45:00", "12:00:00", "21:15:00"])],
    "email": [("contact", "contact address", ["mira@example.org", "jon.h@example.net", "desk@example.com"])],
    "uri": [("link", "link", ["https://example.org/a1", "https://example.net/docs", "https://example.com/x/7"])],
    "uuid": [("ref_id", "reference id", ["3f1c2a9e-8b4d-4c1e-9a7f-2d6b5e0c1a93",
                                         "b7e2d4c0-1f3a-4e8b-8c6d-9a0e5f7b2c14"])],
}
NUMBERS = [
    ("weight_kg", "weight in kg", 0.5, 80.0), ("distance_km", "distance in km", 1.0, 900.0),
    ("budget_eur", "budget in euros", 10.0, 5000.0), ("height_m", "height in metres", 0.2, 40.0),
    ("temperature_c", "temperature in Celsius", -20.0, 45.0), ("volume_l", "volume in litres", 0.1, 60.0),
    ("speed_kmh", "speed in km/h", 5.0, 250.0), ("area_m2", "area in square metres", 4.0, 800.0),
]
INTEGERS = [
    ("quantity", "quantity", 1, 50), ("year", "year", 1950, 2024), ("floor", "floor", 0, 40),
    ("page", "page", 1, 600), ("seats", "number of seats", 1, 9), ("nights", "number of nights", 1, 21),
    ("guests", "number of guests", 1, 12), ("level", "level", 1, 10),
]
BOOLEANS = [
    ("express", "express delivery"), ("gift_wrap", "gift wrapping"), ("refundable", "a refundable fare"),
    ("step_free", "step-free access"), ("vegetarian", "vegetarian options"), ("insured", "insurance"),
]
ENUMS = [
    ("size", "size", ["tiny", "small", "medium", "large", "huge", "giant"]),
    ("pace", "pace", ["slow", "steady", "brisk", "fast", "urgent"]),
    ("finish", "finish", ["bronze", "silver", "gold", "copper", "pewter", "chrome", "brass"]),
    ("season", "season", ["spring", "summer", "autumn", "winter"]),
    ("heading", "heading", ["north", "south", "east", "west", "northeast", "southwest", "northwest", "southeast"]),
    ("tier", "tier", ["basic", "standard", "plus", "premium", "deluxe", "elite"]),
    ("texture", "texture", ["smooth", "grainy", "glossy", "matte", "rough", "woven"]),
]
OBJECTS = [("parcel", "parcel"), ("window", "time window"), ("address", "address"), ("settings", "settings"),
           ("route", "route"), ("box", "box"), ("profile", "profile"), ("layout", "layout")]
ARRAYS = [("stops", "stops"), ("tags", "tags"), ("entries", "entries"), ("picks", "picks"), ("legs", "legs"),
          ("samples", "samples")]
# What a chain's first tool hands the second (with_identifier): (argument name, words); values are made-up
# identifiers, four digits or two letters and three digits.
IDENTIFIERS = [("order_id", "order id"), ("ticket_ref", "ticket reference"), ("member_key", "member key"),
               ("account_tag", "account tag"), ("case_id", "case id"), ("serial", "serial"), ("pass_id", "pass id"),
               ("file_ref", "file reference"), ("parcel_no", "parcel no")]
# Tool names: a verb and what the tool gives.
VERBS = ["get", "find", "check", "estimate", "lookup", "compute", "quote", "measure", "rate", "fetch"]
NOUNS = [("shipping_cost", "shipping cost"), ("tide_level", "tide level"), ("ticket_price", "ticket price"),
         ("paint_code", "paint code"), ("room_rate", "room rate"), ("crop_yield", "crop yield"),
         ("locker_number", "locker number"), ("library_fine", "library fine"), ("parking_fee", "parking fee"),
         ("recipe_score", "recipe score"), ("badge_colour", "badge colour"), ("permit_id", "permit number"),
         ("voucher_code", "voucher code"), ("berth_number", "berth number"), ("sensor_reading", "sensor reading")]
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_KEEP = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength",
         "maxLength", "format", "additionalProperties")


@dataclass(frozen=True)
class Slot:
    """One argument of a twin tool: its schema, and how to draw and say a value of it."""

    name: str
    words: str
    schema: dict  # the JSON schema of this argument in the twin (objects and arrays: their own, recursively)
    kind: str  # string | number | integer | boolean | enum | object | array | null | any
    pool: tuple = ()  # strings or enum values to draw from
    low: float = 0.0
    high: float = 100.0
    fields: tuple["Slot", ...] = ()  # object: its properties
    required: frozenset = frozenset()  # object: the names of its required properties
    items: "Slot | None" = None  # array: its items


@dataclass(frozen=True)
class Twin:
    """A made-up tool with the argument shapes of one of the user's."""

    name: str
    noun: str  # what it gives, as a question says it
    args: Slot  # an object slot: its parameters
    schema: dict = field(default_factory=dict)  # the OpenAI function schema offered to the model
    like: dict = field(default_factory=dict)  # the user's tool it twins: its schema's key order is the twin's

    def offered(self) -> dict:
        """The schema as the model sees it, its keys in the order of the user's (ordered_like)."""
        return ordered_like(self.schema, self.like) if self.like else self.schema


def ordered_like(schema: Any, user: Any) -> Any:
    """`schema` with the keys of each object in the order the user's schema writes them (keys the user's lacks
    last), recursively: a function's name, description and parameters; an argument's type and description; the
    arguments themselves matched by position, as the twins' are. A tool's JSON is read token by token: a model
    warm-started on `{"type": ..., "description": ...}` arguments went on copying the schema (`"description":
    ...`) into its calls when the user's tools wrote `{"description": ..., "type": ...}` (measured on
    tutorial/shop)."""
    if not isinstance(schema, dict) or not isinstance(user, dict):
        return schema
    order = {k: i for i, k in enumerate(user)}
    out = {}
    for key in sorted(schema, key=lambda k: order.get(k, len(order))):  # stable: the user's lacking keys keep theirs
        value = schema[key]
        if key == "properties" and isinstance(value, dict) and isinstance(user.get(key), dict):
            theirs = list(user[key].values())
            value = {name: ordered_like(sub, theirs[i] if i < len(theirs) else {})
                     for i, (name, sub) in enumerate(value.items())}
        elif isinstance(value, dict):
            value = ordered_like(value, user.get(key))
        elif isinstance(value, list) and isinstance(user.get(key), list):
            value = [ordered_like(v, u) for v, u in zip(value, user[key])] + value[len(user[key]):]
        out[key] = value
    return out


def listed(parts: list[str], empty: str = "") -> str:
    """"a", "a and b", "a, b and c"; `empty` for none."""
    return " and ".join([", ".join(parts[:-1]), parts[-1]]) if len(parts) > 1 else parts[0] if parts else empty


def words_of(text: Any) -> set[str]:
    """The lower-cased words of a name, value or sentence ("book_concert_hall" -> book, concert, hall)."""
    return {w for w in re.split(r"[^0-9a-z]+", str(text).lower()) if w}


def user_vocabulary(tools: list[dict]) -> frozenset[str]:
    """What the twins must never say, lower-cased: the tools' names, argument names and enum values, whole and
    word by word, and every word of their descriptions. A pool value with one of these words is not drawn."""
    out: set[str] = set()

    def walk(schema: Any) -> None:
        if isinstance(schema, list):
            for part in schema:
                walk(part)
        if not isinstance(schema, dict):
            return
        for name in schema.get("properties") or {} if isinstance(schema.get("properties"), dict) else {}:
            out.update({str(name).lower(), *words_of(name)})
        for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
            if value is not None:
                out.update({str(value).lower(), *words_of(value)})
        for key, sub in schema.items():
            if key in ("description", "title") and isinstance(sub, str):
                out.update(words_of(sub))
            elif isinstance(sub, (dict, list)):
                walk(sub)

    for tool in tools:
        function = function_of(tool)
        out.update({function["name"].lower(), *words_of(function["name"])})
        walk(function)
    return frozenset(out)


def clean(values, banned: frozenset[str]) -> tuple:
    """The pool values that share no word with the user's vocabulary."""
    return tuple(v for v in values if str(v).lower() not in banned and not words_of(v) & banned)


def _json_type(schema: dict) -> tuple[str, bool]:
    """(the JSON type a value of a plain schema (tool_schema.py) takes, whether null is allowed too)."""
    kind = schema.get("type")
    return kind_of(schema) or "any", isinstance(kind, list) and "null" in kind


class _Namer:
    """Draws names for one object's arguments: never one of the user's, never one used twice in that object."""

    def __init__(self, rng: random.Random, banned: frozenset[str], elsewhere: set[str] | None = None) -> None:
        self.rng, self.banned, self.taken = rng, banned, set()
        # Names other tools of the episode use: avoided while the pool allows, so a question that gives values
        # for two tools never says "the city" twice.
        self.elsewhere = elsewhere if elsewhere is not None else set()

    def pick(self, options: list[tuple]) -> tuple:
        free = [o for o in options if o[0] not in self.taken and o[0] not in self.banned]
        free = [o for o in free if o[0] not in self.elsewhere] or free
        choice = self.rng.choice(free) if free else self.rng.choice(options)
        name, n = choice[0], 2
        while name in self.taken or name in self.banned:  # every pool used up: number it
            name, n = f"{choice[0]}_{n}", n + 1
        self.taken.add(name)
        self.elsewhere.add(name)
        return (name, *choice[1:])


def _twin_slot(schema: dict, namer: _Namer, rng: random.Random, banned: frozenset[str]) -> Slot:
    """The twin of one argument's plain schema (tool_schema.py), named by `namer` (the object that holds it)."""
    kind, nullable = _json_type(schema)
    kept = {k: schema[k] for k in _KEEP if k in schema and k != "additionalProperties"}

    def typed(json_type: str, extra: dict) -> dict:
        return {"type": [json_type, "null"] if nullable else json_type, **extra}

    if schema.get("enum"):
        name, words, pool = _enum_pool(schema["enum"], kind, namer, rng, banned)
        values = [*pool, None] if nullable else list(pool)  # null stays a value the twin accepts
        return Slot(name, words, typed(kind, {"description": f"The {words}.", "enum": values}), "enum", pool)
    if kind == "object":
        name, words = namer.pick(OBJECTS)
        inner = _twin_object(schema, rng, banned)
        return Slot(name, words, {**inner.schema, **typed("object", {"description": f"The {words}."})},
                    "object", fields=inner.fields, required=inner.required)
    if kind == "array":
        name, words = namer.pick(ARRAYS)
        items = _twin_slot(schema.get("items") or {"type": "string"}, _Namer(rng, banned), rng, banned)
        item_schema = {k: v for k, v in items.schema.items() if k != "description"}
        return Slot(name, words, typed("array", {"description": f"The {words}.", "items": item_schema, **kept}),
                    "array", items=items)
    if kind in ("number", "integer"):
        name, words, low, high = namer.pick(NUMBERS if kind == "number" else INTEGERS)
        low, high = _bounds(schema, kind, low, high)
        return Slot(name, words, typed(kind, {"description": f"The {words}.", **kept}), kind, low=low, high=high)
    if kind == "boolean":
        name, words = namer.pick(BOOLEANS)
        return Slot(name, words, typed(kind, {"description": f"Whether to ask for {words}."}), kind)
    if kind == "null":
        name, words, _ = namer.pick(STRINGS)
        return Slot(name, words, {"type": "null", "description": "Always null."}, "null")
    form = schema.get("format") if kind == "string" else None
    name, words, pool = namer.pick(FORMATS[form] if form in FORMATS else STRINGS)
    pool = _fitting(clean(pool, banned), schema, rng)
    extra = {k: v for k, v in kept.items() if k in ("minLength", "maxLength") or k == "format" and form in FORMATS}
    return Slot(name, words, typed("string", {"description": f"The {words}.", **extra}) if kind != "any" else
                {"description": f"The {words}."}, "string" if kind != "any" else "any", pool)


def _bounds(schema: dict, kind: str, low: float, high: float) -> tuple[float, float]:
    """The pool's range [low, high] within the user's bounds; when they do not meet, a range as wide inside the
    user's (from its minimum up, or its maximum down)."""
    step = 1 if kind == "integer" else 0.1  # numbers are drawn to one decimal
    lo = schema.get("minimum", schema.get("exclusiveMinimum", float("-inf")) + step)
    hi = schema.get("maximum", schema.get("exclusiveMaximum", float("inf")) - step)
    if kind == "integer":
        lo, hi = (math.ceil(lo) if math.isfinite(lo) else lo), (math.floor(hi) if math.isfinite(hi) else hi)
    if max(low, lo) <= min(high, hi):
        return float(max(low, lo)), float(min(high, hi))
    span = high - low
    if lo > float("-inf") and hi < float("inf"):
        return float(lo), float(hi)
    return (float(lo), float(lo + span)) if lo > float("-inf") else (float(hi - span), float(hi))


def _fitting(pool: tuple, schema: dict, rng: random.Random) -> tuple:
    """The pool's values of an allowed length; made-up codes of such a length when none is (or the pool is
    empty, every value holding one of the user's words)."""
    shortest, longest = int(schema.get("minLength", 0)), schema.get("maxLength")
    fits = tuple(v for v in pool if len(v) >= shortest and (longest is None or len(v) <= longest))
    if fits:
        return fits
    size = max(shortest, min(6, int(longest) if longest is not None else 6))
    return tuple("".join(rng.choice(LETTERS) for _ in range(size)) for _ in range(8))


def _enum_pool(values: list, kind: str, namer: _Namer, rng: random.Random,
               banned: frozenset[str]) -> tuple[str, str, tuple]:
    """(name, words, as many other values of the same type) for an enum argument."""
    n = len(values)
    if kind in ("integer", "number"):
        name, words, *_ = namer.pick(INTEGERS if kind == "integer" else NUMBERS)
        taken = {v for v in values}
        step = 1 if kind == "integer" else 0.5
        pool = [v for v in (step * k for k in range(1, 4 * n + 50)) if v not in taken]
        drawn = sorted(rng.sample(pool, n))
        return name, words, tuple(int(v) if kind == "integer" else v for v in drawn)
    if kind == "boolean":
        name, words = namer.pick(BOOLEANS)
        return name, words, tuple(values)  # true / false are all there is
    options = [o for o in ENUMS if len(clean(o[2], banned)) >= n]
    if options:
        name, words, pool = namer.pick(options)
        return name, words, tuple(rng.sample(clean(pool, banned), n))
    name, words, _ = namer.pick(ENUMS)  # more values than any pool holds: numbered ones
    return name, words, tuple(f"{words}_{k}" for k in range(1, n + 1))


def _twin_object(schema: dict, rng: random.Random, banned: frozenset[str],
                 elsewhere: set[str] | None = None) -> Slot:
    """The twin of an object schema (a tool's parameters, or a nested object): its properties twinned in order."""
    namer = _Namer(rng, banned, elsewhere)
    required_names = set(schema.get("required") or [])
    fields, required, properties = [], [], {}
    for name, sub in (schema.get("properties") or {}).items():
        slot = _twin_slot(sub, namer, rng, banned)
        fields.append(slot)
        properties[slot.name] = slot.schema
        if name in required_names:
            required.append(slot.name)
    out: dict = {"type": "object", "properties": properties, "required": required}
    if "additionalProperties" in schema:
        out["additionalProperties"] = schema["additionalProperties"]
    return Slot("", "", out, "object", fields=tuple(fields), required=frozenset(required))


def make_twin(tool: dict, rng: random.Random, banned: frozenset[str], taken_names: set[str]) -> Twin:
    """A made-up tool with the argument shapes of `tool`, named apart from `banned` and `taken_names` (the
    episode's tool names, and its tools' argument names, which it adds to)."""
    args = _twin_object(plain_parameters(tool)[0], rng, banned, taken_names)
    unsaid = [n for n in NOUNS if not (words_of(n[0]) | words_of(n[1])) & banned] or NOUNS
    free = [n for n in unsaid if f"noun:{n[0]}" not in taken_names] or unsaid  # two tools never give one thing
    twin = _named(args, rng.choice(free), rng, banned, taken_names)
    return replace(twin, like=tool if "function" in tool else {"type": "function", "function": tool})


def _named(args: Slot, noun: tuple[str, str], rng: random.Random, banned: frozenset[str],
           taken_names: set[str]) -> Twin:
    """The twin with parameters `args` that gives `noun` ((name part, words)), under a fresh verb_noun name."""
    verbs = [v for v in VERBS if v not in banned and f"{v}_{noun[0]}" not in taken_names | banned] or VERBS
    name = f"{rng.choice(verbs)}_{noun[0]}"
    while name in taken_names or name in banned:
        name += "_x"
    taken_names |= {name, f"noun:{noun[0]}"}
    schema = {"type": "function", "function": {"name": name, "description": _description(noun[1], args.fields),
                                               "parameters": args.schema}}
    return Twin(name, noun[1], args, schema)


def with_identifier(twin: Twin, slot: Slot, rng: random.Random, banned: frozenset[str]) -> tuple[Twin, Slot]:
    """`twin` with its string argument `slot` made an identifier (IDENTIFIERS: a name none of the user's words
    says, made-up values), and that new slot; `twin` and `slot` unchanged when every identifier name is taken."""
    if slot.schema.get("format"):  # a date, an address: kept as the user's schema has it
        return twin, slot
    taken = {f.name for f in twin.args.fields}
    options = [o for o in IDENTIFIERS if o[0] not in taken and not (words_of(o[0]) | words_of(o[1])) & banned]
    if not options:
        return twin, slot
    name, words = rng.choice(options)
    if rng.random() < 0.5:
        pool = tuple(str(rng.randint(1000, 9999)) for _ in range(12))
    else:
        pool = tuple(f"{rng.choice(LETTERS)}{rng.choice(LETTERS)}{rng.randint(100, 999)}" for _ in range(12))
    ident = Slot(name, words, {**slot.schema, "description": f"The {words}."}, "string",
                 _fitting(pool, slot.schema, rng))
    return with_slot(twin, slot, ident), ident


def with_slot(twin: Twin, old: Slot, new: Slot) -> Twin:
    """`twin` with its top-level argument `old` replaced by `new` (name, schema, values), in place and in order;
    required when `old` was."""
    fields = tuple(new if f is old else f for f in twin.args.fields)
    schema = {**twin.args.schema, "properties": {f.name: f.schema for f in fields},
              "required": [new.name if r == old.name else r for r in twin.args.schema.get("required", [])]}
    args = replace(twin.args, schema=schema, fields=fields,
                   required=frozenset(new.name if r == old.name else r for r in twin.args.required))
    function = {**twin.schema["function"], "description": _description(twin.noun, fields), "parameters": schema}
    return Twin(twin.name, twin.noun, args, {**twin.schema, "function": function}, twin.like)


def _description(noun: str, fields: tuple[Slot, ...]) -> str:
    """A twin's description: "The tide level, from the city, quantity and size." (what it gives, from what)."""
    said = [f.words for f in fields]
    described = listed(said)
    return f"The {noun}" + (f", from the {described}." if described else ".")
