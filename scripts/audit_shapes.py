"""Data-set shapes people fine-tune on, clean and with planted junk, for measuring the data audit (bench_audit.py
--shapes, tests/test_audit_shapes.py).

Each shape builds `n` legitimate rows (label sets of 2 and 6 classes, yes/no, star ratings, numbers, extraction,
tool-call JSON, chat, multi-turn chat, Python code, SQL, SVG, translation into French) and `plant()` replaces a
share of them with each kind of junk real public sets carry: refusals and AI boilerplate, API/pipeline error
strings (seven kinds), answers cut off at a token limit, the prompt echoed back, answers in another language.
Rows are seeded, so every run builds the same data.
"""

from __future__ import annotations

import json
import random

SUBJECTS = ["the new phone", "this hotel", "the pasta", "our delivery", "the museum tour", "this laptop", "the film",
            "the support team", "the concert", "this jacket", "the app update", "the train ride"]
GOOD = ["was wonderful", "exceeded every expectation", "worked perfectly", "made my day", "was great value"]
BAD = ["was a disappointment", "broke after a day", "was far too slow", "ruined the evening", "was not worth it"]
TOPICS = {"sports": ["the match", "the league", "a striker"], "politics": ["parliament", "the election", "a minister"],
          "technology": ["a chip maker", "the software", "a startup"], "health": ["a vaccine", "the clinic", "sleep"],
          "science": ["a telescope", "the experiment", "fossils"], "arts": ["the gallery", "a novel", "the opera"]}
TOPIC_SHARES = {"sports": 0.40, "politics": 0.25, "technology": 0.15, "health": 0.10, "science": 0.06, "arts": 0.04}
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "Dev Patel", "Emma Novak", "Farid Haddad", "Grace Kim", "Hugo Weber"]
DEVICES = ["light.kitchen", "light.living_room", "light.bedroom", "switch.fan", "switch.heater", "cover.garage",
           "lock.front_door", "climate.hall"]
SERVICES = {"light": ["turn_on", "turn_off"], "switch": ["turn_on", "turn_off"], "cover": ["open_cover", "close_cover"],
            "lock": ["lock", "unlock"], "climate": ["set_temperature"]}
ASKS = ["please {verb} the {name}", "can you {verb} the {name}", "{verb} the {name} now", "I want the {name} {state}",
        "could you {verb} the {name} for me", "{verb} {name}", "hey, {verb} the {name}", "time to {verb} the {name}"]
FACTS = ["Water boils at a lower temperature at high altitude because the air pressure is lower.",
         "Regular exercise improves sleep quality and helps regulate mood.",
         "A budget works best when it tracks both fixed and variable expenses.",
         "Plants convert light into chemical energy through photosynthesis.",
         "Backing up files to two different places protects against most kinds of loss.",
         "Stretching before a run warms the muscles and lowers the risk of strain.",
         "Compound interest grows savings faster the earlier you start.",
         "Short, clear sentences make technical writing easier to follow.",
         "Tomatoes ripen faster when stored next to bananas.",
         "A good night's sleep strengthens memory of what was learnt during the day."]
FOLLOW = ["In practice, {x} is worth keeping in mind.", "Many people find that {x} makes a real difference.",
          "If you are unsure, start small and notice how {x} affects you.", "The key idea is that {x} matters.",
          "Experts generally agree that {x} is a sensible habit.", "Over a few weeks, {x} becomes second nature."]
THEMES = ["planning ahead", "consistency", "a little patience", "checking the details", "asking for help",
          "taking notes", "a regular routine", "clear goals"]
FRENCH = {"good morning": "bonjour", "thank you very much": "merci beaucoup", "the cat is sleeping": "le chat dort",
          "I like the sea": "j'aime la mer", "where is the station": "où est la gare",
          "the house is big": "la maison est grande", "we are going to the market": "nous allons au marché",
          "it is raining today": "il pleut aujourd'hui"}
COLOURS = ["#e53935", "#1e88e5", "#43a047", "#fb8c00", "#8e24aa"]

# Junk as it appears in public sets. Seven kinds of API/pipeline error strings, then the stub story's own string.
ERRORS = ["429 Too Many Requests", "Error: upstream request failed, please retry", "null", "N/A", "None",
          "Traceback (most recent call last):\n  File \"gen.py\", line 41, in <module>\n    text = out['choices'][0]\n"
          "KeyError: 'choices'", '{"error": {"message": "Rate limit reached for requests", "code": 429}}',
          "openai.error.Timeout: Request timed out: HTTPSConnectionPool(host='api.openai.com', port=443)",
          "HTTP 503 Service Unavailable", "No valid response from model."]
REFUSALS = ["I'm sorry, but I can't assist with that.", "As an AI language model, I cannot provide personal opinions.",
            "I cannot help with that request.", "I'm sorry, I am unable to fulfil this request.",
            "As an AI, I don't have the ability to browse the internet, but I can tell you that it depends.",
            "I apologize, but I cannot complete this task as it may violate our content policy."]
FOREIGN = ["这是一个很好的问题。我认为答案取决于具体情况，建议先了解更多细节。",
           "Esta es una respuesta en español que no corresponde con el resto de los datos, pero es muy común.",
           "Это ответ на русском языке, который не совпадает с остальными ответами в наборе данных.",
           "Das ist eine Antwort auf Deutsch, die nicht zu den anderen Antworten passt und die man prüfen sollte."]
FOREIGN_LABELS = ["积极", "positivo", "négatif", "позитив", "sí", "nein"]
JUNK_KINDS = ("refusal", "error", "cut_off", "echo", "language")


def _prose(rng: random.Random, sentences: int = 3) -> str:
    parts = [rng.choice(FACTS)] + [rng.choice(FOLLOW).format(x=rng.choice(THEMES)) for _ in range(sentences - 1)]
    return " ".join(parts)


def sentiment(i, rng):
    good = rng.random() < 0.5
    return f"Review #{i}: {rng.choice(SUBJECTS)} {rng.choice(GOOD if good else BAD)}. Sentiment?", \
        "positive" if good else "negative"


def topics(i, rng):
    topic = rng.choices(list(TOPIC_SHARES), weights=list(TOPIC_SHARES.values()))[0]
    return f"Headline {i}: news about {rng.choice(TOPICS[topic])} today. Topic?", topic


def yes_no(i, rng):
    a, b = rng.randrange(100), rng.randrange(100)
    return f"Question {i}: is {a} greater than {b}?", "yes" if a > b else "no"


def rating(i, rng):
    stars = rng.choices("12345", weights=[10, 10, 20, 30, 30])[0]
    return f"Rate review {i} from 1 to 5: {rng.choice(SUBJECTS)} {rng.choice(GOOD + BAD)}.", stars


def numeric(i, rng):
    a, b = rng.randrange(1, 500), rng.randrange(1, 500)
    return f"Problem {i}: what is {a} + {b}?", str(a + b)


def extraction(i, rng):
    name, day = rng.choice(NAMES), rng.randrange(1, 29)
    text = f"Note {i}: {name} booked a table for {rng.randrange(2, 9)} on 2024-05-{day:02d}."
    return f"Extract the name and date as JSON.\n{text}", json.dumps({"name": name, "date": f"2024-05-{day:02d}"})


def tool_call(i, rng):
    entity = rng.choice(DEVICES)
    domain = entity.split(".")[0]
    service = rng.choice(SERVICES[domain])
    verb = service.replace("_", " ").replace(" cover", "")
    ask = rng.choice(ASKS).format(verb=verb, name=entity.split(".")[1].replace("_", " "), state=verb)
    action = {"domain": domain, "service": service, "target": {"entity_id": entity}}
    return f"[{i}] {ask}", json.dumps(action)


def chat(i, rng):
    return f"Question {i}: can you explain something useful about {rng.choice(THEMES)}?", _prose(rng, rng.randint(2, 4))


def code(i, rng):
    name, k = rng.choice(["scale", "offset", "clip", "pad"]), rng.randrange(2, 9)
    body = f"def {name}_{i}(values):\n    result = []\n    for v in values:\n        result.append(v * {k} + {i})\n" \
           f"    return result"
    return f"Write a Python function {name}_{i} that maps each value v to v * {k} + {i}.", f"```python\n{body}\n```"


def sql(i, rng):
    table, col = rng.choice(["orders", "users", "items"]), rng.choice(["price", "age", "stock"])
    return (f"Task {i}: select rows of {table} where {col} is above {i}.",
            f"SELECT * FROM {table} WHERE {col} > {i} ORDER BY {col} DESC LIMIT {rng.randrange(5, 50)};")


def svg(i, rng):
    body = "".join(f'<circle cx="{rng.randrange(100)}" cy="{rng.randrange(100)}" r="{rng.randrange(3, 30)}" '
                   f'fill="{rng.choice(COLOURS)}"/>' for _ in range(rng.randint(1, 6)))
    return (f"Draw design {i} with circles.",
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{100 + i % 50}" height="100">{body}</svg>')


def translation(i, rng):
    english = rng.choice(list(FRENCH))
    return (f"Translate into French (item {i}): {english}",
            f"{FRENCH[english]} (phrase {i}), comme on le dit souvent dans la langue de tous les jours.")


SHAPES = {"sentiment (2 classes)": sentiment, "topics (6 classes, imbalanced)": topics, "yes/no": yes_no,
          "star rating 1-5": rating, "numeric answers": numeric, "extraction (JSON)": extraction,
          "tool calls (Home Assistant)": tool_call, "chat": chat, "multi-turn chat": chat, "Python code": code,
          "SQL": sql, "SVG": svg, "translation to French": translation}
MULTI_TURN = "multi-turn chat"
LABEL_SHAPES = {"sentiment (2 classes)", "topics (6 classes, imbalanced)", "yes/no", "star rating 1-5"}


def legit_rows(shape: str, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    make = SHAPES[shape]
    return [_row(shape, *make(i, rng), rng, i) for i in range(n)]


def _row(shape: str, prompt: str, answer: str, rng: random.Random, i: int) -> dict:
    if shape != MULTI_TURN:
        return {"prompt": prompt, "completion": answer}
    first_q, first_a = chat(i + 100_000, rng)
    return {"messages": [{"role": "user", "content": first_q}, {"role": "assistant", "content": first_a},
                         {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def _answer(row: dict) -> str:
    return row["messages"][-1]["content"] if "messages" in row else row["completion"]


def _request(row: dict) -> str:
    return row["messages"][-2]["content"] if "messages" in row else row["prompt"]


def _with_answer(row: dict, answer: str) -> dict:
    if "messages" in row:
        turns = [dict(t) for t in row["messages"]]
        turns[-1]["content"] = answer
        return {"messages": turns}
    return {**row, "completion": answer}


def _cut(answer: str, rng: random.Random) -> str | None:
    """The answer stopped at a token limit: mid-sentence for prose, inside the structure for code, JSON, SVG."""
    words = answer.split(" ")
    if len(words) < 8:  # a short JSON object or line: cut inside it
        return answer[: rng.randint(len(answer) // 3, 2 * len(answer) // 3)]
    cut = " ".join(words[: rng.randint(len(words) // 3, 2 * len(words) // 3)])
    return cut.rstrip(".,;:!?") if cut[-1:] in ".!?" else cut


def applicable(shape: str, kind: str) -> bool:
    return not (kind == "cut_off" and (shape in LABEL_SHAPES or shape in {"numeric answers"}))


def plant(rows: list[dict], shape: str, share: float = 0.02, seed: int = 1) -> tuple[list[dict], dict[str, list[int]]]:
    """Rows with `share` of them replaced per junk kind; returns (rows, {kind: planted row indices})."""
    rng = random.Random(seed)
    rows = [dict(r) for r in rows]
    kinds = [k for k in JUNK_KINDS if applicable(shape, k)]
    count = max(1, round(share * len(rows)))
    picks = rng.sample(range(len(rows)), count * len(kinds))
    planted: dict[str, list[int]] = {}
    for n, kind in enumerate(kinds):
        planted[kind] = sorted(picks[n * count:(n + 1) * count])
        for k, i in enumerate(planted[kind]):
            row = rows[i]
            if kind == "refusal":
                answer = REFUSALS[k % len(REFUSALS)]
            elif kind == "error":
                answer = ERRORS[k % len(ERRORS)]
            elif kind == "cut_off":
                answer = _cut(_answer(row), rng)
            elif kind == "echo":
                answer = _request(row)
            else:
                foreign = FOREIGN_LABELS if shape in LABEL_SHAPES else FOREIGN
                answer = foreign[k % len(foreign)]
            rows[i] = _with_answer(row, answer)
    return rows, planted


def measure(shape: str, n: int = 1000, share: float = 0.02, tokenizer=None, max_length: int | None = None) -> dict:
    """Audit, clean and re-audit the clean and the planted variant of one shape, as the recipes' audit cell does.

    Returns {"clean": {"dropped", "stopped", "warnings"}, "junk": {"legit_dropped", "stopped", "missed": {kind:
    planted rows no finding names}, "planted": {kind: rows}, "caught_by": {kind: finding ids}}}."""
    import datasets

    from freetune.audit import audit, clean

    def run(rows):
        data = datasets.Dataset.from_list(rows)
        report = audit(data, tokenizer=tokenizer, max_length=max_length)
        cleaned, _ = clean(data, report)
        after = audit(cleaned, tokenizer=tokenizer, max_length=max_length) if len(cleaned) else None
        dropped = {i for f in report.blocking for i in f.rows}
        return report, dropped, after is None or bool(after.blocking)

    legit = legit_rows(shape, n)
    report, dropped, stopped = run(legit)
    out = {"clean": {"dropped": len(dropped), "stopped": stopped, "warnings": [f.id for f in report.warnings],
                     "labels": report.labels["line"] if report.labels else None}}
    rows, planted = plant(legit, shape, share)
    report, dropped, stopped = run(rows)
    junk = {i for r in planted.values() for i in r}
    named: dict[int, list[str]] = {}
    for f in report.findings:
        for i in f.rows:
            named.setdefault(i, []).append(f.id)
    out["junk"] = {"legit_dropped": len(dropped - junk), "stopped": stopped, "planted": planted,
                   "missed": {k: [i for i in r if i not in named] for k, r in planted.items()},
                   "caught_by": {k: sorted({f for i in r for f in named.get(i, [])}) for k, r in planted.items()},
                   "dropped": {k: sum(1 for i in r if i in dropped) for k, r in planted.items()}}
    return out
