"""Home Assistant task: the answer is one JSON action that Home Assistant could execute in this home.

The action schema (what the recipe trains and what `hass.services.async_call` takes):
    {"domain": "light", "service": "turn_on", "target": {"entity_id": "light.kitchen_light"},
     "data": {"brightness_pct": 50}}
domain and service are lowercase identifiers, target.entity_id is one entity id or a list of them, each
belonging to `domain`, and data is an optional object. The home's entities are listed in the prompt (the
system turn of each row); an entity the answer names that the prompt does not list is invented.
"""

from __future__ import annotations

import json
import re

from freetune.data import completion_text, prompt_text
from freetune.tasks import summarise_metrics

REQUIRED_KEYS = ("domain", "service", "target")
OPTIONAL_KEYS = ("data",)
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
_ENTITY_ID = re.compile(r"[a-z_][a-z0-9_]*\.[a-z0-9_]+")
# An entity id anywhere in the prompt, in whatever format the data set lists devices ("light.kitchen 'Kitchen'",
# "- light.kitchen = on", comma-separated ...). Not followed by a dot or word character, so "e.g." is skipped.
_ENTITY_IN_TEXT = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*\.[a-z0-9_]+)(?![\w.])")


def parse_action(text: str) -> tuple[object, str | None]:
    """(the parsed JSON value, None), or (None, why it is not JSON). The whole answer must be the JSON:
    that is what the integration parses."""
    try:
        return json.loads(text.strip()), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at character {exc.pos})"


def schema_violations(action: object) -> list[str]:
    """Every way the parsed action departs from the schema (empty when it conforms)."""
    if not isinstance(action, dict):
        return [f"expected one JSON object, got {type(action).__name__}"]
    problems = [f"missing {key!r}" for key in REQUIRED_KEYS if key not in action]
    problems += [f"unexpected key {key!r}" for key in action if key not in REQUIRED_KEYS + OPTIONAL_KEYS]
    domain = action.get("domain")
    for key in ("domain", "service"):
        if key in action and not (isinstance(action[key], str) and _IDENTIFIER.fullmatch(action[key])):
            problems.append(f"{key} {action[key]!r} is not a lowercase identifier")
    if "data" in action and not isinstance(action["data"], dict):
        problems.append(f"data should be an object, not {type(action['data']).__name__}")
    if "target" in action:
        target = action["target"]
        if not isinstance(target, dict) or "entity_id" not in target:
            problems.append("target should be an object with an entity_id")
        else:
            ids = target["entity_id"] if isinstance(target["entity_id"], list) else [target["entity_id"]]
            if not ids:
                problems.append("target.entity_id is empty")
            for entity_id in ids:
                if not (isinstance(entity_id, str) and _ENTITY_ID.fullmatch(entity_id)):
                    problems.append(f"entity_id {entity_id!r} is not of the form domain.object_id")
                elif isinstance(domain, str) and entity_id.split(".")[0] != domain:
                    problems.append(f"entity {entity_id} is not in domain {domain!r}")
    return problems


def named_entities(action: object) -> list[str]:
    """The entity ids an action targets (well-formed ones only; the schema check reports the rest)."""
    if not isinstance(action, dict) or not isinstance(action.get("target"), dict):
        return []
    ids = action["target"].get("entity_id")
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if isinstance(i, str) and _ENTITY_ID.fullmatch(i)]


def context_entities(row: dict) -> set[str]:
    """The entity ids the row's prompt (system turn and request) lists."""
    return set(_ENTITY_IN_TEXT.findall(prompt_text(row)))


def _is_json(row: dict) -> str | None:
    return parse_action(completion_text(row))[1]


def _matches_schema(row: dict) -> str | None:
    action, error = parse_action(completion_text(row))
    if error is not None:  # reported once, by the json check
        return None
    problems = schema_violations(action)
    return "; ".join(problems) if problems else None


def _known_entities(row: dict) -> str | None:
    action, error = parse_action(completion_text(row))
    if error is not None:
        return None
    invented = sorted(set(named_entities(action)) - context_entities(row))
    return f"names entities the prompt does not list: {', '.join(invented)}" if invented else None


# Each defect is reported by one check only (broken JSON is not also a schema violation), so counts per check
# add up to the rows flagged.
AUDIT_CHECKS = {
    "json": _is_json,
    "schema": _matches_schema,
    "known_entities": _known_entities,
}


def canonical_action(action: object) -> tuple | None:
    """(domain, service, sorted entity ids, data) of an action, in a form two equal actions share: entity order
    and a missing or empty data object do not matter, 50 and 50.0 are one number. None when it is no action."""
    if not isinstance(action, dict) or schema_violations(action):
        return None
    data = action.get("data") or {}
    numbers = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in data.items()}
    return (action["domain"], action["service"], tuple(sorted(named_entities(action))),
            json.dumps(numbers, sort_keys=True))


def signature(output: str) -> tuple | None:
    """The action an answer asks for, for counting how many different actions an adapter gives across prompts."""
    return canonical_action(parse_action(output)[0])


ADHERENCE = "action_matches"
ADHERENCE_MEANS = "the reference's action: service, entities and data"
SIGNATURE_MEANS = "actions"


def reference_metrics(output: str, reference: str | None) -> dict[str, bool]:
    """The answer against the reference action: service_matches (domain and service), entities_match, data_matches
    and action_matches (all three). Empty when the reference is no valid action."""
    wanted = signature(reference) if reference is not None else None
    if wanted is None:
        return {}
    given = signature(output) or (None, None, None, None)
    service, entities, data = given[:2] == wanted[:2], given[2] == wanted[2], given[3] == wanted[3]
    return {"service_matches": service, "entities_match": entities, "data_matches": data,
            ADHERENCE: service and entities and data}


def metrics(output: str, row: dict) -> dict[str, bool | int]:
    """valid_json, schema_ok, schema_violations (count), invented_entities (count) for one generated output,
    and, when the row has a reference action, whether the answer asks for the same (reference_metrics).

    An answer that is not JSON counts as one schema violation (it is no action at all) and invents nothing.
    """
    action, error = parse_action(output)
    if error is not None:
        result = {"valid_json": False, "schema_ok": False, "schema_violations": 1, "invented_entities": 0}
    else:
        problems = schema_violations(action)
        invented = set(named_entities(action)) - context_entities(row)
        result = {"valid_json": True, "schema_ok": not problems, "schema_violations": len(problems),
                  "invented_entities": len(invented)}
    try:
        reference = completion_text(row)
    except (KeyError, TypeError):  # a row without an answer has nothing to compare with
        reference = None
    result.update(reference_metrics(output, reference))
    return result


def summarise(results: list[dict]) -> dict[str, float]:
    """Shares of valid JSON and schema-conforming answers, and of answers asking for the reference's service,
    entities, data and whole action; schema violations and invented entities per answer."""
    return summarise_metrics(results)
