"""Base vs adapter: both models' generations judged side by side (the sanity numbers, the task's metrics, one verdict
each), as a table, HTML in a notebook, or a dict to save and judge again."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass
from types import ModuleType

from freetune.data import completion_text, prompt_messages
from freetune.errors import FreetuneError
from freetune.evaluate.generation import Generation, generate
from freetune.evaluate.verdict import COLLAPSED, NGRAM, WEAK, _shorten, prompt_following, sanity_report
from freetune.tasks import load_task, reference_metrics, summarise_metrics


# ------------------------------------------------------------------------------------------ base vs adapter

# (label, key, format) of the sanity rows in the table.
_SANITY_ROWS = [
    ("verdict", "verdict", "{}"),
    ("most common output: share", "most_common_share", "{:.0%}"),
    ("most common output: prompts", "most_common_prompts", "{}"),
    (f"repeated {NGRAM}-grams", "repeated_ngram_rate", "{:.0%}"),
    ("ended with EOS", "eos_rate", "{:.0%}"),
    ("mean new tokens", "mean_new_tokens", "{:.1f}"),
]


def _fmt(template: str, value) -> str:
    return "n/a" if value is None else template.format(value)


@dataclass
class ComparisonReport:
    base: dict                      # sanity_report of the base model's generations
    adapter: dict                   # sanity_report of the adapter's
    base_task: dict | None          # task summary (freetune.tasks.<task>.summarise), None without a task
    adapter_task: dict | None
    task: str | None
    prompts: list[str]              # the last user turn of each prompt, for display
    references: list[str | None]
    base_generations: list[Generation]
    adapter_generations: list[Generation]
    adapter_dir: str | None = None
    base_text: dict | None = None     # any task: exact match and similarity to the references (summarise_metrics)
    adapter_text: dict | None = None

    @property
    def collapsed(self) -> bool:
        return self.adapter["verdict"] == "collapsed"

    def examples(self) -> list[dict]:
        """Per prompt: prompt, base, adapter (greedy outputs, else the first sample) and reference.
        Ready for freetune.tasks.svg.side_by_side_png."""
        def pick(generations):
            chosen = {}
            for g in generations:
                if g.mode == "greedy" or g.prompt_index not in chosen:
                    chosen[g.prompt_index] = g.text
            return chosen
        base, adapter = pick(self.base_generations), pick(self.adapter_generations)
        return [{"prompt": p, "base": base.get(i), "adapter": adapter.get(i), "reference": self.references[i]}
                for i, p in enumerate(self.prompts)]

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, base, adapter) rows: the sanity numbers, then the task metrics."""
        rows = [(label, _fmt(f, self.base[key]), _fmt(f, self.adapter[key])) for label, key, f in _SANITY_ROWS]
        rows += self._per_prompt_rows()
        rows += self._following_rows()
        for key, label in (("exact_match", "answer = reference"), ("similarity", "similarity to reference")):
            if self.adapter_text and self.adapter_text.get(key) is not None:
                base = (self.base_text or {}).get(key)
                rows.append((label, _fmt("{:.0%}", base), _fmt("{:.0%}", self.adapter_text[key])))
        if self.base_task and self.adapter_task:
            # The task's metrics count every answer, sampled ones too: said in each label, since "does what was
            # asked (greedy)" above counts the greedy answers alone and the two figures differ.
            over = " (greedy + samples)" if self.adapter["generations"] > self.adapter["prompts"] else ""
            for key, value in self.adapter_task.items():
                if key == "outputs":
                    continue
                is_rate = not key.endswith(("violations", "entities"))
                f = "{:.0%}" if is_rate else "{:.2f} per output"
                rows.append((f"{self.task}: {key}{over}", _fmt(f, self.base_task.get(key)), _fmt(f, value)))
        return rows

    def _per_prompt_rows(self) -> list[tuple[str, str, str]]:
        """How often a prompt asked again got a different answer: "1.0 of 4" is a model sure of its answer (a share
        of distinct outputs over all prompts read 25% there, like a fault)."""
        tries = self.adapter["generations"] / self.adapter["prompts"]
        if tries < 2 or "answers_per_prompt" not in self.adapter:
            return []
        label = f"different answers to one prompt asked {tries:g} times (greedy + samples)"
        return [(label, *(f"{getattr(self, side)['answers_per_prompt']:.1f} of {tries:g}" for side in ("base",
                                                                                                         "adapter")))]

    def _following_rows(self) -> list[tuple[str, str, str]]:
        base, adapter = self.base.get("following"), self.adapter.get("following")
        if not base or not adapter:
            return []
        rows = []
        if adapter["adherence"] is not None:
            rows.append(("does what was asked (greedy)", _fmt("{:.0%}", base["adherence"]),
                         _fmt("{:.0%}", adapter["adherence"])))
        wanted = adapter["reference_distinct_answers"]
        rows.append((f"different {adapter['answers_mean']}, greedy (references: {wanted})",
                     f"{base['distinct_answers']} of {base['answers']}", f"{adapter['distinct_answers']} of "
                     f"{adapter['answers']}"))
        return rows

    def table(self) -> str:
        """A plain-text table, base vs adapter columns, then the verdict and warnings in words."""
        rows = [("metric", "base", "adapter")] + self.rows()
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for side in ("base", "adapter"):
            report = getattr(self, side)
            lines.append(f"{side}: {report['verdict'].upper()}: {report['reason']}")
            lines += [f"{side}: warning: {w}" for w in report["warnings"]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"task": self.task, "adapter_dir": self.adapter_dir, "base": self.base, "adapter": self.adapter,
                "base_task": self.base_task, "adapter_task": self.adapter_task, "base_text": self.base_text,
                "adapter_text": self.adapter_text, "examples": self.examples(),
                "base_generations": [asdict(g) for g in self.base_generations],
                "adapter_generations": [asdict(g) for g in self.adapter_generations]}

    def _repr_html_(self) -> str:
        esc = html.escape
        out = []
        if self.collapsed:
            out.append(f'<div style="background:#fdd;border:2px solid #c00;padding:8px;margin:4px 0">'
                       f'<b>The adapter has COLLAPSED</b>: {esc(self.adapter["reason"])}<pre style="white-space:'
                       f'pre-wrap">{esc(_shorten(self.adapter["most_common_output"], 1000))}</pre></div>')
        out.append("<table><thead><tr><th>metric</th><th>base</th><th>adapter</th></tr></thead><tbody>")
        for label, base, adapter in self.rows():
            style = ' style="color:#c00;font-weight:bold"' if adapter == COLLAPSED else (
                ' style="color:#b60"' if adapter == WEAK else "")
            out.append(f"<tr><td>{esc(label)}</td><td>{esc(base)}</td><td{style}>{esc(adapter)}</td></tr>")
        out.append("</tbody></table>")
        for side in ("base", "adapter"):
            report = getattr(self, side)
            out.append(f"<p><b>{side}</b>: {esc(report['verdict'])}: {esc(report['reason'])}</p>")
            out += [f"<p>⚠ {side}: {esc(w)}</p>" for w in report["warnings"]]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.table()


def _last_user_turn(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def compare_model(model, tokenizer, rows, *, task: str | ModuleType | None = None, greedy: bool = True,
                  seeds=(0, 1, 2), temperature: float = 0.7, max_new_tokens: int = 256,
                  batch_size: int = 8, adapter_dir: str | None = None) -> ComparisonReport:
    """Base vs adapter on an already loaded peft model (the notebook's trained model, or one compare loaded).

    rows: normalised rows (freetune.data.normalize); each gives a prompt and the reference answer.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise FreetuneError(
            f"compare needs the model with its LoRA adapter attached (a peft PeftModel), got "
            f"{type(model).__name__}. Pass the trained model before merging, or use compare(base, adapter_dir, ...).")
    task_module = load_task(task)
    rows = [dict(row) for row in rows]
    prompts = [prompt_messages(row) for row in rows]
    options = dict(greedy=greedy, seeds=seeds, temperature=temperature, max_new_tokens=max_new_tokens,
                   batch_size=batch_size)
    print(f"Generating from {len(rows)} held-out prompt(s), with the adapter and without ...", flush=True)
    adapter_generations = generate(model, tokenizer, prompts, **options)
    with model.disable_adapter():
        base_generations = generate(model, tokenizer, prompts, **options)
    return judge(rows, base_generations, adapter_generations, task=task_module, adapter_dir=adapter_dir)


def judge(rows, base_generations: list[Generation], adapter_generations: list[Generation], *,
          task: str | ModuleType | None = None, adapter_dir: str | None = None) -> ComparisonReport:
    """The report on generations already made (compare_model's, or ones saved with to_dict): sanity numbers,
    task metrics against each row's reference, and one verdict per model. Needs no model, so a saved run can be
    judged again by a newer freetune."""
    task_module = load_task(task)
    rows = [dict(row) for row in rows]
    references = [completion_text(row) for row in rows]

    def judged(generations):
        task_metrics = ([task_module.metrics(g.text, rows[g.prompt_index]) for g in generations]
                        if task_module else [])
        text_metrics = [reference_metrics(g.text, references[g.prompt_index]) for g in generations]
        following = prompt_following(generations, rows, task_metrics, task_module)
        summary = task_module.summarise(task_metrics) if task_module else None
        return summary, summarise_metrics(text_metrics), sanity_report(generations, references, following=following)

    base_task, base_text, base = judged(base_generations)
    adapter_task, adapter_text, adapter = judged(adapter_generations)
    return ComparisonReport(
        base=base, adapter=adapter, base_task=base_task, adapter_task=adapter_task,
        task=task_module.__name__.rsplit(".", 1)[-1] if task_module else None,
        prompts=[_last_user_turn(prompt_messages(row)) for row in rows], references=references,
        base_generations=base_generations, adapter_generations=adapter_generations, adapter_dir=adapter_dir,
        base_text=base_text, adapter_text=adapter_text)
