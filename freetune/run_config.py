"""RunConfig: one record of a run's settings, the one channel from the parameters cell to every later cell.

The notebook builds it once from its parameters cell (every value checked by freetune.params), adds the run's
folders and the preflight plan, and every later cell reads `run.<name>`. On Kaggle the same record is the job file
the training script reads under torchrun (`run.save(path)` in the notebook, `RunConfig.load(path)` in each rank), so
the ranks train on exactly what the notebook showed, without a second list of names to keep in step.

    run = freetune.RunConfig.from_cell(globals(), recipe="svg_coder", target="colab")
    run = run.preflight()                      # the plan for this machine; Hub tokens checked before any training
    run = run.with_paths()                     # the run's folders (on Colab, Google Drive if use_drive)
    run.lora_rank, run.plan.batch.micro_batch, run.paths.adapter
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

# Parameters a recipe may leave out of its cell, and what the story reads then (the library's own defaults).
OPTIONAL = {"task": "", "torch_compile": "auto", "gpu_memory_cap_gib": 0.0, "ddp_processes": 0, "system_prompt": "",
            "time_budget_min": 0.0, "hub_checkpoint_repo": "", "hub_repo": "", "export_gguf": False, "use_drive": False,
            "output_dir": "", "dataset_split": "train", "columns": {}, "chat_template": "auto"}

# make_plan's keyword <- the parameter that asks for it ("or None": the cell's 0 means "let the plan choose").
_PLAN_KEYWORDS = {"model_shape": "model_id", "max_length": "max_length", "grad_accum": "grad_accum",
                  "lora_rank": "lora_rank", "gradient_checkpointing": "gradient_checkpointing",
                  "optimizer": "optimizer", "precision": "precision", "lora_dropout": "lora_dropout",
                  "compile": "torch_compile"}
_ZERO_MEANS_AUTO = {"micro_batch": "micro_batch", "memory_budget_gib": "gpu_memory_cap_gib"}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    parameters: dict[str, Any]   # the parameters cell, checked (freetune.params.check)
    recipe: str = ""             # the recipe the notebook was generated from ("" for a hand-written run)
    target: str | None = None    # the platform the notebook was built for (None: this machine's)
    paths: Any = None            # freetune.platform.Paths, once with_paths has run
    plan: Any = None             # freetune.plan.Plan, once preflight has run (re-sized by replan)

    def __getattr__(self, name: str) -> Any:
        # `run.lora_rank` reads the parameters cell; a name a recipe's cell may leave out reads its default.
        if name.startswith("__"):
            raise AttributeError(name)
        parameters = self.__dict__.get("parameters", {})
        if name in parameters:
            return parameters[name]
        if name in OPTIONAL:
            return OPTIONAL[name]
        raise AttributeError(f"{name!r} is not a parameter of this run; the parameters are: {', '.join(parameters)}")

    @classmethod
    def from_cell(cls, namespace: dict, *, recipe: str | None = "", target: str | None = None) -> RunConfig:
        """The parameters cell's values (a notebook's globals()), each checked against its declared type and rule;
        a name papermill was given that the cell does not declare is an error too (freetune.params.check).
        recipe, target: filled in by build_notebooks.py (None in the recipe file: a plain local run)."""
        from freetune import params

        return cls(parameters=params.check(namespace), recipe=recipe or "", target=target)

    def plan_request(self) -> dict[str, Any]:
        """make_plan's keywords, from the parameters that ask for them (those this recipe's cell has)."""
        asked = {keyword: getattr(self, name) for keyword, name in _PLAN_KEYWORDS.items()
                 if name in self.parameters}
        asked |= {keyword: getattr(self, name) or None for keyword, name in _ZERO_MEANS_AUTO.items()
                  if name in self.parameters}
        return asked

    def preflight(self) -> RunConfig:
        """This run with its plan for this machine (freetune.plan.make_plan); the tracking options and any Hub
        repo's write access checked now: a missing token must stop the run before hours of training, not after."""
        from freetune import secrets, tracking
        from freetune.plan import make_plan

        plan = make_plan(**self.plan_request())
        tracking.check_options(report_to=self.report_to, eval_steps=self.eval_steps, eval_rows=self.eval_rows)
        for parameter in ("hub_repo", "hub_checkpoint_repo"):
            if getattr(self, parameter):
                secrets.require_hub_write(getattr(self, parameter), parameter)
        return dataclasses.replace(self, plan=plan)

    def with_paths(self) -> RunConfig:
        """This run with its folders (freetune.platform.resolve_paths: output_dir, run_name, use_drive)."""
        from freetune.platform import resolve_paths

        paths = resolve_paths(target=self.target, output_dir=self.output_dir, run_name=self.run_name,
                              use_drive=self.use_drive)
        print(f"run folder: {paths.run_dir}")
        return dataclasses.replace(self, paths=paths)

    def replan(self, **changes) -> RunConfig:
        """This run with its plan re-sized (e.g. longest_row, once the audit has counted the rows)."""
        from freetune.plan import replan

        return dataclasses.replace(self, plan=replan(self.plan, **changes))

    def sft_config(self, **settings):
        """The Trainer's settings for this run (freetune.sft_config.make_config: the plan's batch and precision, the
        parameters' steps, learning rate, logging and checkpoints); keywords as make_config's."""
        from freetune.sft_config import make_config

        return make_config(self.paths, self.plan, self.parameters, **settings)

    # ------------------------------------------------------------------ the job file (Kaggle's torchrun ranks)

    def save(self, path: str | Path) -> Path:
        """Write this run as JSON (the job file train_ddp.py reads); returns the path."""
        record = {"recipe": self.recipe, "target": self.target, "parameters": self.parameters,
                  "paths": dataclasses.asdict(self.paths) if self.paths is not None else None,
                  "plan": dataclasses.asdict(self.plan) if self.plan is not None else None}
        path = Path(path)
        path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """The run a notebook saved, in a torchrun rank: its plan re-decided for the job's size (WORLD_SIZE), which
        the notebook, planning for its own machine, could not see (several hosts, or CPU ranks)."""
        from freetune.platform import Paths
        from freetune.plan import Plan, for_world

        record = json.loads(Path(path).read_text())
        plan = None
        if record.get("plan") is not None:
            # The memory estimate is for display in the notebook; the ranks need only the decisions (from_dict).
            plan = Plan.from_dict(record["plan"])
            plan = for_world(plan, int(os.environ.get("WORLD_SIZE", "1")))
        paths = Paths(**record["paths"]) if record.get("paths") is not None else None
        return cls(parameters=record["parameters"], recipe=record.get("recipe", ""), target=record.get("target"),
                   paths=paths, plan=plan)
