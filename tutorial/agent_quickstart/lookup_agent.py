"""The agent quick-start's agent as plain Python, without astuner: the task's tools and prompt (lookup_task.py adds
its judge), and `answer()`, an ordinary tool-calling loop on any `openai.AsyncOpenAI` (openai_agent.py wraps it in
a Workflow; tutorial/remote_agent/agent_client.py runs it from the light client install, `clients/remote`).

Codes are kept by badge number: `find_badge(name)` gives the badge, `lookup_code(badge)` the code. Both are made
up (derived from a hash), so no model knows them: an episode succeeds only when the agent calls `find_badge`,
passes the badge it read to `lookup_code` and writes the code inside \\boxed{}: three model calls at least.
"""

import hashlib
import json

FIRST = ["Mira", "Tomas", "Ines", "Oskar", "Leila", "Bruno", "Saanvi", "Kofi", "Yara", "Emil", "Noor", "Dario",
         "Anya", "Felix", "Hana", "Jonas"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Castillo", "Haddad", "Novak", "Mensah", "Ferreira", "Kowalski"]
NAMES = [f"{first} {last}" for last in LAST for first in FIRST]  # 160 people
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
SYSTEM = ("You answer questions about access codes. Codes are kept by badge number: first call find_badge with "
          "the person's full name, then call lookup_code with the badge number it gives, then give the code inside "
          "\\boxed{}. Never guess.")
QUESTION = "What is the access code of {name}?"
MAX_TURNS = 4


def code_of(name: str) -> str:
    digest = hashlib.sha256(("astuner:" + name).encode()).digest()
    letters = LETTERS[digest[0] % len(LETTERS)] + LETTERS[digest[1] % len(LETTERS)]
    return f"{letters}-{int.from_bytes(digest[2:4], 'big') % 10000:04d}"


def badge_of(name: str) -> str:
    return str(int.from_bytes(hashlib.sha256(("badge:" + name).encode()).digest()[:4], "big") % 9000 + 1000)


CODES = {name: code_of(name) for name in NAMES}
BADGES = {name: badge_of(name) for name in NAMES}


def find_badge(name: str) -> str:
    """The badge number of a person, by full name.

    Args:
        name (str): The person's full name.
    """
    wanted = " ".join(str(name).split()).lower()
    for known, badge in BADGES.items():
        if known.lower() == wanted:
            return f"{known} has badge {badge}."
    return f"No person named {name!r}. Use the person's full name."


def lookup_code(badge: str) -> str:
    """The access code kept for a badge number.

    Args:
        badge (str): The badge number.
    """
    wanted = str(badge).strip()
    for known, number in BADGES.items():
        if number == wanted:
            return f"Badge {number} has access code {CODES[known]}."
    return f"No badge {badge!r}. Badge numbers have four digits; find_badge gives them."


def tool_schema(name: str, description: str, argument: str, about: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": about}},
                       "required": [argument]}}}


TOOL_SCHEMAS = [tool_schema("find_badge", "The badge number of a person, by full name.", "name", "The person's full name."),
                tool_schema("lookup_code", "The access code kept for a badge number.", "badge", "The badge number.")]
TOOLS = {"find_badge": find_badge, "lookup_code": lookup_code}


async def answer(client, question: str, system: str = SYSTEM, tools: dict = TOOLS, max_turns: int = MAX_TURNS) -> str:
    """The agent's tool loop: ask, run the tools it calls, until it answers (or `max_turns` calls)."""
    schemas = [s for s in TOOL_SCHEMAS if s["function"]["name"] in tools]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            tool = tools.get(call.function.name)
            try:
                result = tool(**json.loads(call.function.arguments or "{}")) if tool else \
                    f"Error: no tool named {call.function.name!r}; the tools are {', '.join(tools)}."
            except (TypeError, ValueError) as error:  # arguments the tool does not take: the agent reads why
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""
