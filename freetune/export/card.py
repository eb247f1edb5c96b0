"""The model card (README.md) for the Hub: how the adapter was made (base model, data set, recipe, parameters with
no secret in them, data audit, evaluation) and how to load it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from freetune.params import HUB_ID as _HUB_ID
from freetune.secrets import redact


_SECRET_KEYS = re.compile(r"(^|_)(token|secret|password|api_key|apikey)$", re.I)


def _clean_parameters(parameters: dict) -> dict:
    """Parameters fit to publish: names that hold secrets dropped, any token inside a value redacted."""
    return {key: (redact(value) if isinstance(value, str) else value)
            for key, value in parameters.items() if not _SECRET_KEYS.search(str(key))}


def _md_cell(value) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    elif isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, default=str)
    text = redact(str(value)).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _eval_markdown(eval_table) -> str:
    """eval_table: rows (metric, base, adapter) as freetune.evaluate.ComparisonReport.rows() gives, or a dict metric -> value, or
    metric -> {column: value}."""
    if isinstance(eval_table, (list, tuple)):
        rows = [list(r) for r in eval_table]
        width = max(len(r) for r in rows)
        header = ["metric", "base", "adapter"] if width == 3 else ["metric"] + [f"value {i}" for i in range(1, width)]
        return _md_table(header, rows)
    if all(isinstance(v, dict) for v in eval_table.values()):
        columns = list(dict.fromkeys(c for v in eval_table.values() for c in v))
        return _md_table(["metric", *columns], [[m, *(v.get(c, "") for c in columns)] for m, v in eval_table.items()])
    return _md_table(["metric", "value"], [[k, v] for k, v in eval_table.items()])


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name or "")) and not Path(name).exists()


def model_card(*, base_model: str, dataset: str, recipe: str, parameters: dict, audit_summary: dict | None,
               eval_table=None, repo_id: str, extra_files: dict | None = None) -> str:
    """A README.md for the Hub: YAML front matter (base_model, library_name: peft, tags, datasets) and sections
    recording the base model, data set, recipe, parameters (never a token), data audit and evaluation.

    extra_files: {filename: what it is} for files the repo holds besides the adapter (GGUF, Modelfile).
    """
    import yaml  # PyYAML: a dependency of transformers, so always present

    front = {"base_model": base_model, "library_name": "peft", "pipeline_tag": "text-generation",
             "tags": ["freetune", "lora", "qlora", "sft", "trl",
                      re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")]}
    if _looks_like_hub_id(dataset):  # a local file is recorded in the text, not as a Hub data set id
        front["datasets"] = [dataset]
    params = _clean_parameters(parameters)
    name = repo_id.split("/")[-1]
    sections = [
        "---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---",
        f"# {name}",
        f"A LoRA adapter for [{base_model}](https://huggingface.co/{base_model}), fine-tuned with QLoRA by the "
        f"freetune recipe `{recipe}`.",
        "## Training",
        _md_table(["what", "value"], [["base model", base_model], ["data set", dataset], ["recipe", recipe]]),
        "### Parameters",
        _md_table(["parameter", "value"], [[k, v] for k, v in params.items()]) if params else "(none recorded)",
        "## Data audit",
        (_md_table(["finding", "value"], [[k, v] for k, v in audit_summary.items()]) if audit_summary
         else "No audit summary was recorded."),
        "## Evaluation",
        _eval_markdown(eval_table) if eval_table else "No evaluation was recorded.",
        "## Use",
        "```python\nfrom peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({repo_id!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})\n```",
    ]
    if extra_files:
        sections += ["## Files", _md_table(["file", "what"], [[k, v] for k, v in extra_files.items()])]
    return redact("\n\n".join(sections) + "\n")
