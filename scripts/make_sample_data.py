"""Write the bundled sample data sets (freetune/sample_data/*.jsonl), shaped like the real ones.

Deterministic (seeded), so rerunning it reproduces the committed files byte for byte. The rows are small and
varied on purpose: the embedded default and CI train on them with a tiny model on a CPU.

- svg_sample.jsonl: like thesantatitan/deepseek-svg-dataset: `prompt` (a description) -> `completion` (SVG code).
- svg_short_sample.jsonl: the same task in rows a small real model learns on a CPU in minutes (command 1 with
  --real-model): colour names, four sizes, three shapes drawn in percentages, ~65 answer tokens.
- alpaca_sample.jsonl: instruction / input / output rows (the Alpaca shape, recognised by its column names).
- home_assistant_sample.jsonl: like a Home Assistant requests -> JSON action set, as `messages`: a system turn
  listing the home's entities, the user's request, and the assistant's JSON action.
- multiturn_sample.jsonl: `messages` with two or three exchanges each (a follow-up question builds on the answer
  before it), so every assistant turn carries loss, not only the last.
- sharegpt_sample.jsonl: ShareGPT rows, `conversations` of {"from": "system" | "human" | "gpt", "value": ...} turns.

Usage: python scripts/make_sample_data.py [--out freetune/sample_data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = ["red", "blue", "green", "orange", "purple", "black", "teal", "gold", "pink", "gray"]
HEX = {"red": "#e53935", "blue": "#1e88e5", "green": "#43a047", "orange": "#fb8c00", "purple": "#8e24aa",
       "black": "#000000", "teal": "#00897b", "gold": "#fdd835", "pink": "#d81b60", "gray": "#757575"}


def svg_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        shape = rng.choice(["circle", "square", "triangle", "two circles", "striped flag"])
        fg, bg = rng.sample(COLOURS, 2)
        size = rng.choice([64, 100, 128, 200])
        half = size // 2
        if shape == "circle":
            body = f'<circle cx="{half}" cy="{half}" r="{rng.randint(size // 5, half - 4)}" fill="{HEX[fg]}"/>'
        elif shape == "square":
            side = rng.randint(size // 3, size - 10)
            off = (size - side) // 2
            body = f'<rect x="{off}" y="{off}" width="{side}" height="{side}" fill="{HEX[fg]}"/>'
        elif shape == "triangle":
            body = f'<polygon points="{half},6 {size - 6},{size - 6} 6,{size - 6}" fill="{HEX[fg]}"/>'
        elif shape == "two circles":
            r = size // 5
            body = (f'<circle cx="{r + 4}" cy="{half}" r="{r}" fill="{HEX[fg]}"/>'
                    f'<circle cx="{size - r - 4}" cy="{half}" r="{r}" fill="{HEX[fg]}"/>')
        else:
            stripe = size // 3
            body = "".join(f'<rect x="0" y="{i * stripe}" width="{size}" height="{stripe}" '
                           f'fill="{HEX[fg] if i % 2 == 0 else HEX[bg]}"/>' for i in range(3))
        prompt = rng.choice([
            f"Draw a {fg} {shape} on a {bg} background, {size} pixels wide.",
            f"Create an SVG icon: a {fg} {shape} over {bg}, size {size}x{size}.",
            f"Generate SVG code for a {size}px image showing a {fg} {shape} with a {bg} background.",
        ])
        completion = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" '
                      f'viewBox="0 0 {size} {size}"><rect width="{size}" height="{size}" fill="{HEX[bg]}"/>'
                      f"{body}</svg>")
        rows.append({"prompt": prompt, "completion": completion})
    return rows


# Colour names whose colour families (freetune.tasks.svg.colour_family) all differ, so the task metrics can tell
# whether the answer used the asked colours.
SHORT_COLOURS = ["red", "orange", "yellow", "green", "teal", "blue", "purple", "pink", "black", "white", "gray"]
# Drawn in percentages of the canvas: the same element for every size, so the size is copied from the prompt once.
# Each shape is named as its element is (a "square" drawn as <rect> and an "oval" as <ellipse> were still mixed up
# after 24 steps, when the colours, copied from the prompt, were right).
SHORT_SHAPES = {"circle": '<circle cx="50%" cy="50%" r="35%" fill="{fg}"/>',
                "rectangle": '<rect x="20%" y="30%" width="60%" height="40%" fill="{fg}"/>',
                "ellipse": '<ellipse cx="50%" cy="50%" rx="40%" ry="25%" fill="{fg}"/>'}


def svg_short_rows(n: int, rng: random.Random) -> list[dict]:
    """A shape of one colour on a background of another, at one of four sizes: what the prompt asks is all the
    answer varies by, so an adapter that ignores the prompt shows at once in the task metrics."""
    rows = []
    for _ in range(n):
        shape = rng.choice(sorted(SHORT_SHAPES))
        fg, bg = rng.sample(SHORT_COLOURS, 2)
        size = rng.choice([64, 100, 128, 200])
        prompt = rng.choice([f"Draw a {fg} {shape} on a {bg} background, {size} pixels wide.",
                             f"SVG icon, {size}x{size}: a {fg} {shape} on {bg}."])
        completion = (f'<svg width="{size}" height="{size}"><rect width="100%" height="100%" fill="{bg}"/>'
                      + SHORT_SHAPES[shape].format(fg=fg) + "</svg>")
        rows.append({"prompt": prompt, "completion": completion})
    return rows


ROOMS = ["kitchen", "living room", "bedroom", "office", "hallway", "garage", "bathroom"]
DEVICES = {
    "light": [("turn_on", "Turn on the {name}."), ("turn_off", "Switch off the {name}."),
              ("turn_on", "Set the {name} to {pct}% brightness.")],
    "switch": [("turn_on", "Turn on the {name}."), ("turn_off", "Turn the {name} off.")],
    "cover": [("open_cover", "Open the {name}."), ("close_cover", "Close the {name}.")],
    "climate": [("set_temperature", "Set the {name} to {temp} degrees.")],
    "media_player": [("media_pause", "Pause the {name}."), ("volume_set", "Set the {name} volume to {pct}%.")],
}
DEVICE_NAMES = {"light": "light", "switch": "fan switch", "cover": "blinds", "climate": "thermostat",
                "media_player": "speaker"}
SYSTEM_HEADER = ("You control a smart home. Answer with one JSON action: domain, service, target.entity_id and "
                 "optional data. Devices in this home:\n")


def home_assistant_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        rooms = rng.sample(ROOMS, 3)
        entities = []
        for room in rooms:
            for domain in rng.sample(sorted(DEVICES), 3):
                entity_id = f"{domain}.{room.replace(' ', '_')}_{DEVICE_NAMES[domain].replace(' ', '_')}"
                entities.append((entity_id, f"{room.title()} {DEVICE_NAMES[domain].title()}", domain))
        entity_id, friendly, domain = rng.choice(entities)
        service, template = rng.choice(DEVICES[domain])
        pct, temp = rng.choice([20, 40, 50, 75, 100]), rng.choice([18, 19, 20, 21, 22, 23])
        request = template.format(name=friendly.lower(), pct=pct, temp=temp)
        data = {}
        if "brightness" in template or "%" in template and domain == "light":
            data = {"brightness_pct": pct}
        elif service == "set_temperature":
            data = {"temperature": temp}
        elif service == "volume_set":
            data = {"volume_level": pct / 100}
        action = {"domain": domain, "service": service, "target": {"entity_id": entity_id}, "data": data}
        device_list = "\n".join(f"{eid} '{name}'" for eid, name, _ in entities)
        rows.append({"messages": [
            {"role": "system", "content": SYSTEM_HEADER + device_list},
            {"role": "user", "content": request},
            {"role": "assistant", "content": json.dumps(action, sort_keys=True)},
        ]})
    return rows


def alpaca_rows(n: int, rng: random.Random) -> list[dict]:
    """instruction / input / output rows (the Alpaca shape), for the column-mapping path."""
    rows = []
    for _ in range(n):
        kind = rng.choice(["add", "reverse", "upper", "count"])
        if kind == "add":
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": str(a + b)})
        elif kind == "reverse":
            word = rng.choice(["kitchen", "garden", "window", "yellow", "planet", "rocket", "silver"])
            rows.append({"instruction": "Write the word backwards.", "input": word, "output": word[::-1]})
        elif kind == "upper":
            phrase = " ".join(rng.sample(["red", "fast", "cat", "home", "blue", "light", "open", "door"], 3))
            rows.append({"instruction": "Repeat the phrase in capital letters.", "input": phrase,
                         "output": phrase.upper()})
        else:
            colour = rng.choice(COLOURS)
            rows.append({"instruction": f"How many letters are in the word {colour}?", "input": "",
                         "output": f"The word {colour} has {len(colour)} letters."})
    return rows


WORDS = ["kitchen", "garden", "window", "yellow", "planet", "rocket", "silver", "forest", "bridge", "candle",
         "basket", "pencil", "summer", "winter", "orange", "castle", "dragon", "island", "jacket", "ladder",
         "magnet", "needle", "pepper", "rabbit", "saddle", "tunnel", "velvet", "walnut", "anchor", "button"]


def _exchange(rng: random.Random) -> list[tuple[str, str]]:
    """Two or three (question, answer) pairs in which each follow-up needs the answer before it."""
    kind = rng.choice(["sum", "word", "list"])
    if kind == "sum":
        a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
        turns = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
                 (f"And that times {c}?", f"{a + b} times {c} is {(a + b) * c}.")]
        if rng.random() < 0.5:
            turns.append(("Is that an even number?", "Yes, it is even." if (a + b) * c % 2 == 0 else "No, it is odd."))
        return turns
    if kind == "word":
        word = rng.choice(WORDS)
        follow_ups = [("Now in capital letters.", word[::-1].upper()),
                      ("What is its first letter?", f"The first letter is {word[-1]}."),
                      ("How many letters is that?", f"{len(word)} letters.")]
        return [(f"Spell {word} backwards.", word[::-1])] + rng.sample(follow_ups, rng.choice([1, 2]))
    items = rng.sample(COLOURS, 3)
    return [(f"Sort these colours alphabetically: {', '.join(items)}.", ", ".join(sorted(items))),
            ("Which one comes last?", sorted(items)[-1].capitalize() + ".")]


def conversations(n: int, rng: random.Random) -> list[list[tuple[str, str]]]:
    """n conversations of (role, text) turns: half open with a system turn, then two or three exchanges."""
    rows = []
    for _ in range(n):
        turns = [("system", "You answer briefly.")] if rng.random() < 0.5 else []
        for question, answer in _exchange(rng):
            turns += [("user", question), ("assistant", answer)]
        rows.append(turns)
    return rows


def multiturn_rows(n: int, rng: random.Random) -> list[dict]:
    """Chat `messages` of several exchanges: the loss must be on every assistant turn."""
    return [{"messages": [{"role": r, "content": t} for r, t in turns]} for turns in conversations(n, rng)]


SHAREGPT_SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt_rows(n: int, rng: random.Random) -> list[dict]:
    """ShareGPT's shape: `conversations` of {"from": "system" | "human" | "gpt", "value": ...}."""
    return [{"conversations": [{"from": SHAREGPT_SPEAKERS[r], "value": t} for r, t in turns]}
            for turns in conversations(n, rng)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "freetune" / "sample_data"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "svg_sample.jsonl", svg_rows(240, random.Random(0)))
    write_jsonl(out / "svg_short_sample.jsonl", svg_short_rows(160, random.Random(5)))
    write_jsonl(out / "home_assistant_sample.jsonl", home_assistant_rows(240, random.Random(1)))
    write_jsonl(out / "alpaca_sample.jsonl", alpaca_rows(240, random.Random(2)))
    write_jsonl(out / "multiturn_sample.jsonl", multiturn_rows(240, random.Random(3)))
    write_jsonl(out / "sharegpt_sample.jsonl", sharegpt_rows(240, random.Random(4)))
    print(f"wrote svg, svg_short, home_assistant, alpaca, multiturn and sharegpt _sample.jsonl files to {out}")


if __name__ == "__main__":
    main()
