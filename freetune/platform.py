"""Colab, Kaggle and a local machine differ in a handful of facts; they live here, as one table.

build_notebooks.py applies the table to the cells a recipe tags explicitly (`install`, `run`, `train`) and to
the notebook metadata; at run time `resolve_paths` turns the table's folders into real ones (a notebook built
for Colab but executed elsewhere, CI or a laptop, falls back to local folders and says so), and `require_hub`
says at once when the Hub is out of reach (Kaggle's Internet switch off).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from freetune.errors import FreetuneError


@dataclass(frozen=True)
class Platform:
    name: str
    gpus: str                    # what the notebook is built for, shown to the user
    work_root: str               # scratch space for this session (lost when it ends)
    persistent_root: str | None  # where checkpoints outlive the session ("" until the user opts in, on Colab)
    secrets: str                 # where HF_TOKEN comes from
    time_limit_h: float | None   # the platform's session limit: the time budget stops and saves before it
    launches_ddp: bool           # the notebook writes train_ddp.py and runs it under torchrun on every GPU
    metadata: dict               # notebook metadata the platform reads (accelerator, internet)
    before_run: str = ""         # what the user sets before "Run all" (the notebook's first cell says it)
    keeps_runs: str = ""         # what outlives the session (the notebook's "Next steps" cell says it)


PLATFORMS = {
    "colab": Platform(
        name="colab", gpus="1 x T4 (16 GB)", work_root="/content/freetune-runs",
        persistent_root="/content/drive/MyDrive/freetune-runs", secrets="Colab secrets (key icon): HF_TOKEN",
        time_limit_h=12.0, launches_ddp=False,
        # Colab reads `accelerator` and `colab.gpuType` to pick the runtime when the notebook opens.
        metadata={"accelerator": "GPU", "colab": {"gpuType": "T4", "provenance": []}},
        before_run="**On Colab:** Runtime -> Change runtime type -> **T4 GPU**, then Runtime -> Run all.",
        keeps_runs=("Colab deletes the run folder with the runtime: `use_drive = True` keeps it on Google Drive, "
                    "`hub_checkpoint_repo` keeps every checkpoint on the Hub."),
    ),
    "kaggle": Platform(
        name="kaggle", gpus="2 x T4 (15 GB each)", work_root="/kaggle/working/freetune-runs",
        persistent_root="/kaggle/working/freetune-runs", secrets="Kaggle secrets (Add-ons > Secrets): HF_TOKEN",
        time_limit_h=12.0, launches_ddp=True,
        # Kaggle reads `kaggle.accelerator` ("nvidiaTeslaT4" is "GPU T4 x2") and needs internet for pip.
        metadata={"kaggle": {"accelerator": "nvidiaTeslaT4", "dataSources": [], "isGpuEnabled": True,
                             "isInternetEnabled": True, "language": "python", "sourceType": "notebook"}},
        before_run=("**On Kaggle:** Settings -> Accelerator -> **GPU T4 x2**, and Settings -> Internet **on** (the "
                    "install cell downloads the pinned libraries), then Run all."),
        keeps_runs=("Kaggle keeps /kaggle/working only in a saved version (Save Version); `hub_checkpoint_repo` "
                    "keeps every checkpoint on the Hub."),
    ),
    "local": Platform(
        name="local", gpus="whatever this machine has", work_root="freetune-runs", persistent_root="freetune-runs",
        secrets="the HF_TOKEN environment variable", time_limit_h=None, launches_ddp=False, metadata={},
    ),
}


def detect() -> str:
    """Which platform this process runs on: 'colab', 'kaggle' or 'local'."""
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return "colab"
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE") or os.environ.get("KAGGLE_URL_BASE"):
        return "kaggle"
    return "local"


@dataclass(frozen=True)
class Paths:
    platform: str
    run_dir: str          # everything of this run: checkpoints, adapter, reports
    checkpoints: str      # Trainer checkpoints (resume from here)
    adapter: str          # the final LoRA adapter
    data: str             # the audited, cleaned data the training script reads
    reports: str          # summaries, plots, evaluation

    @classmethod
    def under(cls, run_dir, platform: str = "local") -> "Paths":
        """The run's folders inside run_dir (not created: .make() does that, on the main process)."""
        run_dir = str(run_dir)
        return cls(platform=platform, run_dir=run_dir, checkpoints=f"{run_dir}/checkpoints",
                   adapter=f"{run_dir}/adapter", data=f"{run_dir}/data", reports=f"{run_dir}/reports")

    def make(self) -> "Paths":
        for folder in (self.run_dir, self.checkpoints, self.data, self.reports):
            Path(folder).mkdir(parents=True, exist_ok=True)
        return self


def resolve_paths(target: str | None, output_dir: str, run_name: str, use_drive: bool = False) -> Paths:
    """The run's folders. target is the platform the notebook was built for; where it does not match the
    machine (a Colab notebook in CI), local folders are used instead.

    output_dir: the user's choice; empty picks the platform's default (Drive on Colab when use_drive is on).
    """
    actual = detect()
    if target and target != actual:
        print(f"Built for {target}, running on {actual}: using {actual} folders.")
    platform = PLATFORMS[actual]
    if output_dir:
        root = output_dir
    elif actual == "colab" and use_drive:
        _mount_drive()
        root = platform.persistent_root
    else:
        root = platform.work_root
    paths = Paths.under(Path(root).expanduser() / run_name, platform=actual)
    try:
        paths.make()
        # Here, not at the top: the checkpoint package reads the platforms table (stop.py, through secrets.py), so
        # a module-level import would make a circle.
        from freetune.checkpoint import lock

        lock.acquire(paths.run_dir)  # one run per folder: a second run or notebook is refused here
    except OSError as exc:  # read-only, a file where a folder must be, no permission: before anything is loaded
        raise FreetuneError(f"Cannot write the run folder {paths.run_dir} ({type(exc).__name__}: "
                            f"{exc.strerror or exc}{': ' + exc.filename if exc.filename else ''}). Set output_dir "
                            f"to a folder you can write to{' (now ' + repr(output_dir) + ')' if output_dir else ''}, "
                            f"or leave it empty for the platform's default.") from None
    return paths


def _mount_drive() -> None:
    from google.colab import drive  # only importable on Colab

    if not Path("/content/drive/MyDrive").exists():
        drive.mount("/content/drive")


def require_hub(what: str, parameter: str, advice: str = "") -> None:
    """Stop at once, saying what to change, when `what` must come from the Hugging Face Hub and the Hub cannot be
    reached. Without this, each library retries each file about five times over half a minute and the error that
    finally comes is a chain of five exceptions. Nothing is checked in offline mode (HF_HUB_OFFLINE=1): the
    libraries then read their cache and never touch the network."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return
    problem = _hub_problem(constants.ENDPOINT)
    if problem:
        raise FreetuneError(
            f"Cannot reach the Hugging Face Hub ({constants.ENDPOINT}: {problem}), so {what} cannot "
            f"{'be reached' if advice else 'be downloaded'}. Turn the internet on (Kaggle: Settings -> Internet on, "
            f"then rerun; Colab: reconnect the runtime), " + (advice + "." if advice else
            f"or set `{parameter}` to a local folder or file. Files downloaded before load with HF_HUB_OFFLINE=1."))


@functools.cache
def _hub_problem(endpoint: str) -> str | None:
    """None when the endpoint answers at all (any HTTP status), else why not. Asked once per process."""
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=10)
    except Exception as exc:  # httpx's ConnectError, ConnectTimeout, ProxyError, ...: the network failed
        return f"{type(exc).__name__}: {str(exc).strip() or 'no answer'}"
    return None
