"""Write the bundled sample data sets (freetune/sample_data/*.jsonl), shaped like the real ones.

Deterministic (seeded), so rerunning it reproduces the committed files byte for byte. The rows are small and
varied on purpose: the embedded default and CI train on them with a tiny model on a CPU.

- svg_sample.jsonl: like thesantatitan/deepseek-svg-dataset: `prompt` (a description) -> `completion` (SVG code).
- alpaca_sample.jsonl: instruction / input / output rows, trained through a column mapping.
- home_assistant_sample.jsonl: like a Home Assistant requests -> JSON action set, as `messages`: a system turn
  listing the home's entities, the user's request, and the assistant's JSON action.

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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "freetune" / "sample_data"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "svg_sample.jsonl", svg_rows(240, random.Random(0)))
    write_jsonl(out / "home_assistant_sample.jsonl", home_assistant_rows(240, random.Random(1)))
    write_jsonl(out / "alpaca_sample.jsonl", alpaca_rows(240, random.Random(2)))
    print(f"wrote svg_sample.jsonl, home_assistant_sample.jsonl and alpaca_sample.jsonl to {out}")


if __name__ == "__main__":
    main()
