"""Other tools, for the SFT warm start's demonstrations: they teach the tool-call protocol (call with the argument
names the schema gives, read the result, pass it on, answer inside \\boxed{}) without ever showing the lookup
task's tools, so learning that task is left to RL."""

import hashlib
import json

from lookup_task import tool_schema as _schema

CITIES = ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hobart", "Bergen", "Cusco"]
ROUTES = ["Oslo to Rome", "Lima to Quito", "Cairo to Tunis", "Perth to Hobart", "Riga to Vilnius",
          "Seoul to Busan", "Porto to Madrid", "Dakar to Accra"]
ITEMS = ["blue kettle", "oak chair", "wool scarf", "steel ladder", "glass vase", "paper lamp", "clay bowl",
         "linen towel"]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def weather(city: str) -> str:
    return WEATHER[_hash(city) % len(WEATHER)]


def flight(route: str) -> str:
    return f"{'KLMNPRSTW'[_hash(route) % 9]}{_hash(route + '#') % 900 + 100}"


def gate(flight_number: str) -> str:
    return f"{'ABCDE'[_hash(flight_number) % 5]}{_hash(flight_number + '#') % 40 + 1}"


def price(item: str) -> str:
    return str(_hash(item) % 90 + 10)


GATE_SCHEMA = _schema("get_gate", "The boarding gate of a flight, by flight number.", "number", "The flight number.")
GATE_SYSTEM = ("You answer questions about boarding gates. Gates are kept by flight number: first call find_flight "
               "with the route, then call get_gate with the flight number it gives, then give the gate inside "
               "\\boxed{}.")

# (tool schema, values, system prompt, question, tool result, answer) per tool; each is one demo family.
FAMILIES = [
    (_schema("get_weather", "Today's weather in a city.", "place", "The city."), CITIES,
     "You answer questions about the weather. Call the get_weather tool, then give the weather inside \\boxed{}.",
     "What is the weather in {x} today?", lambda x: f"Today in {x}: {weather(x)}.", weather),
    (_schema("find_flight", "The flight number of a route.", "trip", "The route, as 'A to B'."), ROUTES,
     "You answer questions about flights. Call the find_flight tool, then give the flight number inside "
     "\\boxed{}.", "Which flight goes {x}?", lambda x: f"Flight {flight(x)} flies {x}.", flight),
    (_schema("get_price", "The price of an item in the shop, in euros.", "product", "The item."), ITEMS,
     "You answer questions about prices. Call the get_price tool, then give the price inside \\boxed{}.",
     "How much does the {x} cost?", lambda x: f"The {x} costs {price(x)} euros.", price),
]


def chained_demonstration(route: str) -> tuple[list[dict], list[dict]]:
    """(tools, messages) of a two-call episode: find_flight, then get_gate with the number it gave."""
    number = flight(route)
    calls = [("find_flight", {"trip": route}, f"Flight {number} flies {route}."),
             ("get_gate", {"number": number}, f"Flight {number} boards at gate {gate(number)}.")]
    messages = [{"role": "system", "content": GATE_SYSTEM},
                {"role": "user", "content": f"At which gate does the flight {route} board?"}]
    for i, (name, arguments, result) in enumerate(calls):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
    messages.append({"role": "assistant", "content": f"The answer is \\boxed{{{gate(number)}}}."})
    return [FAMILIES[1][0], GATE_SCHEMA], messages
