"""The synthetic tasks of the tiny trained Beam, in Beam's chat format, and the prompts the gates send.

One source for both: `beam_hpu.tiny.train` trains on these texts and the gates' CPU profile asks
the same questions, so a gate that fails on the tiny model means the serving path lost something
the model had (a window, a gate, an expert), not that the model never learnt the wording. The
Gaudi profile uses the same prompt shapes with English filler (the 501B model reads anything).

Every builder takes a `random.Random` and returns plain data (messages, tools, expected answers);
nothing here needs torch. `Tasks` turns them into token-level samples with the tiny model's
tokenizer (what the trainer draws and the CPU perplexity gate scores).
"""

from __future__ import annotations

import random
import string

CITIES = [
    "Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Madrid", "Dublin", "Vienna",
    "Prague", "Lisbon", "Athens", "Quito", "Seoul", "Hanoi", "Nairobi", "Denver", "Austin", "Perth",
]
TOPICS = ["rust books", "cheap flights", "tide tables", "jazz records", "chess openings", "rice recipes",
          "bus routes", "solar panels", "old maps", "bike repair"]
ENGLISH = ("the a river town walked slowly past old stone houses while evening light fell across quiet "
           "streets and small boats moved along the water near market stalls where people sold bread "
           "fruit cloth and tools to travellers who had come from distant hills").split()


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER_TOOL = _tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
SEARCH_TOOL = _tool("search", {"query": {"type": "string"}}, ["query"])
TIME_TOOL = _tool("get_time", {"city": {"type": "string"}}, ["city"])
TOOLS = [WEATHER_TOOL, SEARCH_TOOL, TIME_TOOL]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
EFFORTS = ["none", "minimal", "low", "medium", "high"]


# ---------------------------------------------------------------------------------------------
# Filler text


def printable_token_ids(tokenizer) -> list[int]:
    """Ids of ordinary tokens that decode to printable ASCII without markup characters."""
    ids = []
    for _, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        s = tokenizer.decode([i])
        if s and s.isascii() and s.isprintable() and not set(s) & set("<|>") and i not in tokenizer.all_special_ids:
            ids.append(i)
    return ids


def filler_text(rng: random.Random, n_pieces: int, pieces: list[str]) -> str:
    """`n_pieces` random pieces (decoded tokens for the tiny model, English words otherwise)."""
    return "".join(rng.choice(pieces) for _ in range(n_pieces))


def english_pieces() -> list[str]:
    return [" " + w for w in ENGLISH]


def random_key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(5))


def random_code(rng: random.Random) -> str:
    return "".join(rng.choice(string.digits) for _ in range(4))


# ---------------------------------------------------------------------------------------------
# Needle retrieval (needles gate, isolation gate)


def needle_sentence(key: str, code: str) -> str:
    return f" The code for {key} is {code}."


def needle_question(key: str) -> str:
    return f"\n\nWhat is the code for {key}?"


def needle_prompt(haystack: str, key: str, code: str | None, depth: float) -> str:
    """`haystack` with the needle planted at `depth` (0..1 of its characters), then the question.
    `code=None` plants nothing (the control)."""
    cut = int(len(haystack) * depth)
    planted = haystack[:cut] + (needle_sentence(key, code) if code is not None else "") + haystack[cut:]
    return planted.strip() + needle_question(key)


def needle_answer(key: str, code: str) -> tuple[str, str]:
    """(reasoning, final) the tiny model is trained to give."""
    return f"The code for {key} is {code}.", code


# ---------------------------------------------------------------------------------------------
# Echo (smoke gate)


def echo_task(rng: random.Random, max_words: int = 3) -> tuple[str, str]:
    """(prompt, expected answer): the tiny model repeats one to three words."""
    words = " ".join(rng.choice(CITIES) for _ in range(rng.randint(1, max_words)))
    return f"Repeat after me: {words}", words


def echo_answer(words: str) -> tuple[str, str]:
    return f"The user wants {words}.", words


# ---------------------------------------------------------------------------------------------
# Tool use (tools gate): each prompt with its natural call(s)


def weather_prompt(city: str, days: int | None) -> str:
    return f"What is the weather in {city}" + (f" for {days} days?" if days else "?")


def weather_calls(city: str, days: int | None) -> list[tuple[str, dict]]:
    return [("get_weather", {"city": city, **({"days": days} if days else {})})]


def parallel_prompt(a: str, b: str) -> str:
    return f"What is the weather in {a} and in {b}?"


def search_prompt(topic: str) -> str:
    return f"Search the web for {topic}."


def time_prompt(city: str) -> str:
    return f"What time is it in {city}?"


def json_prompt(city: str) -> str:
    return f"Reply in JSON: the city is {city}."


def json_answer(city: str) -> str:
    return '{"city": "' + city + '"}'


def json_conversation(rng: random.Random) -> list[dict]:
    """A JSON answer asked for without tools (the json_schema tools case sends no tools)."""
    city = rng.choice(CITIES)
    return [{"role": "user", "content": json_prompt(city)}, assistant_answer(f"JSON with city {city}.", json_answer(city))]


def tool_reasoning(names: list[str]) -> str:
    if len(names) == 2 and names[0] == names[1]:
        return f"Call {names[0]} twice."
    return "Call " + " and ".join(names) + "."


def assistant_calls(reasoning: str, calls: list[tuple[str, dict]]) -> dict:
    return {"role": "assistant", "reasoning": reasoning, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
        for k, (n, a) in enumerate(calls)]}


def assistant_answer(reasoning: str, answer: str) -> dict:
    return {"role": "assistant", "reasoning": reasoning, "content": answer}


def tool_conversation(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """A random tools-offered conversation and the assistant turn it is trained to produce.

    Mostly the natural behaviour (call the tool the question asks for; answer directly when no tool
    fits). A quarter of the turns with a natural call are what a forced `tool_choice` makes of the
    same question (a direct answer for `none`, another tool for a named choice): the prompt does not
    say which choice was made, the grammar does, so the model must be able to complete any branch
    the grammar leaves it (seen with a tenth: forced into an answer, it wandered to max_tokens).
    """
    tools = rng.sample(TOOLS, rng.randint(2, 3))
    if WEATHER_TOOL not in tools and rng.random() < 0.7:
        tools[0] = WEATHER_TOOL
    names = [t["function"]["name"] for t in tools]
    city, other = rng.sample(CITIES, 2)
    kind = rng.choice(["weather", "weather", "parallel", "parallel", "search", "time", "json", "echo"])
    if kind == "search" and "search" not in names or kind == "time" and "get_time" not in names:
        kind = "weather"
    if kind in ("weather", "parallel") and "get_weather" not in names:
        kind = "echo"
    days = rng.choice([None, rng.randint(1, 9)])
    if kind == "weather":
        prompt, calls = weather_prompt(city, days), weather_calls(city, days)
    elif kind == "parallel":
        prompt, calls = parallel_prompt(city, other), weather_calls(city, None) + weather_calls(other, None)
    elif kind == "search":
        topic = rng.choice(TOPICS)
        prompt, calls = search_prompt(topic), [("search", {"query": topic})]
    elif kind == "time":
        prompt, calls = time_prompt(city), [("get_time", {"city": city})]
    elif kind == "json":
        prompt, calls = json_prompt(city), []
    else:
        prompt, words = echo_task(rng)
        calls = []
    reasoning = tool_reasoning([n for n, _ in calls]) if calls else None
    forced = rng.random()
    if calls and forced < 0.15:
        # tool_choice "none" on a tool question: answer with the subject.
        turn = assistant_answer(reasoning, calls[0][1].get("city", calls[0][1].get("query", city)))
    elif calls and forced < 0.25:
        # A named tool_choice other than the natural one: fill it from the question.
        subject = calls[0][1].get("city") or calls[0][1].get("query")
        name = rng.choice([n for n in names if n != calls[0][0]])
        args = {"query": subject} if name == "search" else {"city": subject}
        turn = assistant_calls(reasoning, [(name, args)])
    elif calls:
        turn = assistant_calls(reasoning, calls)
    elif kind == "json":
        turn = assistant_answer(f"JSON with city {city}.", json_answer(city))
    else:
        turn = assistant_answer(*echo_answer(words))
    return tools, [{"role": "user", "content": prompt}, turn]


# ---------------------------------------------------------------------------------------------
# Token-level samples (need the tiny model's tokenizer)


class Tasks:
    """Token-level samples of each kind: (ids, loss_mask) lists, loss_mask[i] true where token i
    is a training target. The trainer draws them; the CPU perplexity gate scores the same kinds."""

    def __init__(self, tokenizer, max_len: int, copy_min: int = 12):
        self.tok = tokenizer
        self.max_len = max_len
        self.copy_min = copy_min
        self.pieces = [tokenizer.decode([i]) for i in printable_token_ids(tokenizer)]
        self.ret = tokenizer.convert_tokens_to_ids("<|return|>")
        self.end = tokenizer.convert_tokens_to_ids("<|end|>")

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def chat(self, messages: list[dict], tools=None, effort: str = "medium") -> tuple[list[int], list[bool]]:
        kw = dict(tools=tools, reasoning_effort=effort, tokenize=False)
        prompt = self.tok.apply_chat_template(messages[:-1], add_generation_prompt=True, **kw)
        full = self.tok.apply_chat_template(messages, **kw)
        assert full.startswith(prompt), (prompt, full)
        p_ids, a_ids = self.encode(prompt), self.encode(full[len(prompt):])
        if a_ids[-1] == self.end:  # a final answer ends the turn with <|return|>, as served
            a_ids[-1] = self.ret
        return p_ids + a_ids, [False] * len(p_ids) + [True] * len(a_ids)

    def copy(self, rng: random.Random):
        n = rng.randint(self.copy_min, (self.max_len - 8) // 2)
        ids = self.encode(filler_text(rng, n, self.pieces))[: (self.max_len - 8) // 2]
        return ids + ids, [False] * (len(ids) + 1) + [True] * (len(ids) - 1)

    def needle(self, rng: random.Random):
        key, code = random_key(rng), random_code(rng)
        hay = filler_text(rng, rng.choice([0, rng.randint(0, self.max_len - 110)]), self.pieces)
        prompt = needle_prompt(hay, key, code, rng.random())
        turn = assistant_answer(*needle_answer(key, code))
        return self.chat([{"role": "user", "content": prompt}, turn], effort=rng.choice(EFFORTS))

    def echo(self, rng: random.Random):
        prompt, words = echo_task(rng)
        turn = assistant_answer(*echo_answer(words))
        return self.chat([{"role": "user", "content": prompt}, turn], effort=rng.choice(EFFORTS))

    def json(self, rng: random.Random):
        return self.chat(json_conversation(rng), effort=rng.choice(EFFORTS))

    def tools(self, rng: random.Random):
        tools, messages = tool_conversation(rng)
        return self.chat(messages, tools=tools, effort=rng.choice(EFFORTS))

    def sample(self, rng: random.Random, mix: list[tuple[str, float]]):
        """One sample of a kind drawn from `mix` ((kind, weight) pairs summing to 1)."""
        r, acc = rng.random(), 0.0
        for name, w in mix:
            acc += w
            if r < acc:
                break
        ids, mask = getattr(self, name)(rng)
        return name, ids[: self.max_len], mask[: self.max_len]
