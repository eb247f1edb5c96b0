"""The Kaggle notebook's DDP cell: run train_ddp.py under torchrun on every visible GPU, stream rank 0's
output into the notebook live, and fail the cell with the failing rank's error when any rank fails.

The notebook kernel decides everything first (parameters, folders, the preflight plan, the audited data) and
hands it to the ranks in one JSON job file beside the script (freetune.run_config.RunConfig: `run.save(path)` in
the notebook, `RunConfig.load(path)` in each rank), so every rank trains on exactly what the notebook showed.
torchrun (PyTorch's own launcher) starts the processes; nothing here re-implements it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from freetune.console import duration
from freetune.errors import FreetuneError

RANK0_PREFIX = "[default0]:"  # what torchrun's --tee puts before each line of local rank 0 (role "default")
LAUNCHER_LOG = "torchrun.log"  # torchrun's own messages, kept out of the notebook
FREETUNE_ERROR = "\nfreetune.errors.FreetuneError: "  # a rank's traceback ends in one: its message is what counts


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rendezvous_args(*, nproc: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                    rdzv_id: str = "freetune", is_host: bool | None = None) -> list[str]:
    """torchrun's arguments that place this launcher in the job: --standalone on one host; on several, the same
    c10d rendezvous on every host (HOST:PORT of the first machine, one job id), so no launcher of our own is needed.

    node_rank is passed for the logs' sake: the c10d rendezvous numbers the hosts itself (GROUP_RANK), so which
    host holds global rank 0, the one that writes, is decided when they meet (each rank logs where it is).
    is_host: whether this launcher serves the rendezvous store (torchrun guesses it from the endpoint's hostname;
    give it when that guess cannot work, e.g. two launchers on one machine).
    """
    if nnodes <= 1:
        return ["--standalone", f"--nproc_per_node={nproc}"]
    if not rdzv_endpoint or ":" not in rdzv_endpoint:
        raise FreetuneError(f"A {nnodes}-host job needs rdzv_endpoint='HOST:PORT' (the first machine's address and a "
                            f"free port that every host can reach), got {rdzv_endpoint!r}.")
    if not 0 <= node_rank < nnodes:
        raise FreetuneError(f"node_rank {node_rank} is outside 0..{nnodes - 1} for a {nnodes}-host job.")
    args = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}"]
    if is_host is not None:
        args.append(f"--rdzv_conf=is_host={str(is_host).lower()}")
    return args


def run_torchrun(script: str | Path, job_file: str | Path, *, nproc: int = 0, log_dir: str | Path | None = None,
                 timeout_s: float | None = None, nnodes: int = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None, rdzv_id: str = "freetune", is_host: bool | None = None) -> None:
    """torchrun --standalone --nproc_per_node=N script job_file; raise with the failing rank's error.

    nproc: 0 means one process per visible GPU (one on a CPU-only machine). Ranks beyond 0 log to files only.
    nnodes > 1: this host's share of a multi-host job (see rendezvous_args); every host runs the same call with
    its own node_rank, and the job fails on every host when one host's ranks die.
    """
    gpus = visible_gpus()
    nproc = nproc or max(gpus, 1)
    if gpus and nproc > gpus:
        raise FreetuneError(f"{nproc} processes asked for, but only {gpus} GPU(s) are visible. Set `ddp_processes` "
                            f"to 0 (one per GPU) or at most {gpus}.")
    log_dir = Path(log_dir or Path(job_file).parent / "torchrun_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    placement = rendezvous_args(nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                                rdzv_id=rdzv_id, is_host=is_host)
    cmd = [sys.executable, "-m", "torch.distributed.run", *placement,
           # Every rank's output goes to files; local rank 0's is also echoed here, live.
           "--log-dir", str(log_dir), "--tee", "3", "--local-ranks-filter", "0",
           str(script), str(job_file)]
    where = f"{nproc} GPU(s)" if gpus else f"{nproc} CPU process(es), gloo backend"
    if nnodes > 1:
        where += f" on this host, node {node_rank} of {nnodes}"
    print(f"Launching: torchrun {' '.join(placement)} {Path(script).name}  ({where})", flush=True)
    # OMP_NUM_THREADS: torchrun sets 1 per rank when it is unset, with a banner saying so; set here, silently.
    # The prefix template is torchrun's default, so rank 0's lines are the ones that start with RANK0_PREFIX.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", None)
    started = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          bufsize=1) as proc, open(log_dir / LAUNCHER_LOG, "a") as launcher_log:
        assert proc.stdout is not None
        try:
            for line in rank0_lines(proc.stdout, launcher_log):
                print(line, flush=True)
                if timeout_s and time.time() - started > timeout_s:
                    proc.terminate()
                    raise FreetuneError(f"The torchrun job ran past {duration(timeout_s)} and was stopped.")
            code = proc.wait()
        except BaseException:
            proc.terminate()  # an interrupted cell must not leave ranks training in the background
            raise
    if code != 0:
        rank, error = failing_rank_error(log_dir)
        who = f"rank {rank}" if nnodes <= 1 else f"local rank {rank} of this host (node_rank {node_rank})"
        raise FreetuneError(f"The torchrun job failed (exit code {code}); {who} reported:\n{error}")
    ranks = f"All {nproc} ranks" if nnodes <= 1 else f"This host's {nproc} rank(s) of a {nnodes}-host job"
    print(f"{ranks} finished in {duration(time.time() - started)} (loading, training and saving).", flush=True)


def rank0_lines(stream, launcher_log):
    """Local rank 0's lines as the rank printed them, from torchrun's merged output: without the tee prefix (also
    where a partial line made torchrun repeat it mid-line) and without runs of blank lines. torchrun's own messages
    go to launcher_log."""
    blank = True  # no blank line before the first one
    for raw in stream:
        if RANK0_PREFIX not in raw:
            launcher_log.write(raw)
            continue
        line = raw.replace(RANK0_PREFIX, "").rstrip()
        if line or not blank:
            yield line
        blank = not line


def failing_rank_error(log_dir: str | Path) -> tuple[str, str]:
    """The first rank (by time of its last write) whose stderr holds a Python traceback, and that traceback."""
    logs = sorted(Path(log_dir).glob("**/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime)
    newest_run = max((p.parents[2] for p in logs), key=lambda p: p.stat().st_mtime, default=None)
    for path in logs:
        if newest_run is not None and path.parents[2] != newest_run:
            continue
        text = path.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            # torch prefixes each line of a rank's uncaught exception with "[rankN]: "
            tail = re.sub(r"(?m)^\[rank\d+\]: ?", "", text[text.rindex("Traceback (most recent call last)"):])
            if FREETUNE_ERROR in tail:  # written for the user: its message says it all, as in the notebook
                return path.parent.name, tail[tail.index(FREETUNE_ERROR) + len(FREETUNE_ERROR):].strip()
            return path.parent.name, _short(tail)
    return "?", (f"no rank left a Python traceback (killed by a signal or out of memory?); see {log_dir} "
                 f"({LAUNCHER_LOG} holds torchrun's own messages)")



def _short(traceback_text: str, keep: int = 25) -> str:
    lines = traceback_text.strip().splitlines()
    return "\n".join(lines if len(lines) <= keep else lines[:3] + ["  ..."] + lines[-(keep - 4):])
