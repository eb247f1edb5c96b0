"""One recipe's training on several machines: the Kaggle notebook's own train_ddp.py under torchrun's c10d rendezvous.
Run from the repository root (it imports scripts.run_recipe and build_notebooks):

    # print the exact commands for two machines (nothing runs)
    python -m scripts.multihost svg_coder --head 10.0.0.1:29500
    # on each machine, K = 0 on the first, 1 on the second: prepare, then join the job
    python -m scripts.multihost svg_coder --head 10.0.0.1:29500 --node-rank K --run

What `--run` does on each machine, the same everywhere:
1. prepare: executes notebooks/kaggle/<recipe>.ipynb's cells up to its training script exactly as the notebook
   would (parameters, -p overrides injected after them as papermill does, preflight, folders, data audit), then
   writes that notebook's `%%writefile train_ddp.py` cell to <out>/train_ddp.py and the job file (parameters,
   folders, plan) to <run folder>/train_ddp.json. Same parameters and seed give every host the same data; or run
   `--prepare` on one host and copy <out> to the others (same path).
2. torchrun --nnodes=2 --node_rank=K --nproc_per_node=<GPUs> --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT
   --rdzv_id=<id> train_ddp.py <job>: PyTorch's own launcher, so a host that dies ends the job on every host.

HOST:PORT is the first machine's address and a free TCP port every machine can reach (the rendezvous store runs
there); the data and collective traffic use further ports between all hosts (NCCL / gloo pick them). c10d numbers
the hosts itself: whichever host ends up holding global rank 0 writes the checkpoints and the adapter into its
run folder, and every rank's first log line says which node and rank it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(recipe: str, parameters: dict, out: Path, *, nnodes: int = 1, nproc: int = 1) -> tuple[Path, Path]:
    """Run the Kaggle notebook's cells before its training script (as papermill would), write train_ddp.py and
    the job file; returns (script, job_file)."""
    import nbformat

    import dataclasses

    from build_notebooks import parameter_names
    from freetune.plan import for_world

    notebook = ROOT / "notebooks" / "kaggle" / f"{recipe}.ipynb"
    if not notebook.exists():
        raise SystemExit(f"{notebook} does not exist (recipes: {sorted(p.stem for p in (ROOT / 'recipes').glob('*.py'))})")
    out.mkdir(parents=True, exist_ok=True)
    namespace: dict = {"__name__": "__main__"}
    names: list[str] = []
    script = None
    previous = Path.cwd()
    os.chdir(out)  # the notebook's relative paths (train_ddp.py, its default folders) land in <out>, as in papermill
    try:
        for index, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
            if cell.cell_type != "code":
                continue
            tags = cell.metadata.get("tags", [])
            if "train-script" in tags:
                script = out / "train_ddp.py"
                script.write_text(cell.source.split("\n", 1)[1])  # the cell minus its %%writefile line
                break
            exec(compile(cell.source, f"<{notebook.name} cell {index}>", "exec"), namespace)
            if "parameters" in tags:
                names = parameter_names(cell.source)
                unknown = sorted(set(parameters) - set(names))
                if unknown:
                    raise SystemExit(f"{recipe} has no parameter(s) {unknown}; it has {names}")
                namespace.update(parameters)  # papermill's injected-parameters cell
    finally:
        os.chdir(previous)
    if script is None:
        raise SystemExit(f"{notebook} has no cell tagged train-script")
    run = namespace["run"]  # the notebook's RunConfig: parameters, folders, plan
    # The notebook's preflight saw this host only; the ranks of the whole job share each optimizer step.
    run = dataclasses.replace(run, plan=for_world(run.plan, nnodes * nproc, hosts=nnodes))
    return script, run.save(Path(run.paths.run_dir) / "train_ddp.json")


def torchrun_line(script: str, job: str, *, nnodes: int, node_rank: int, nproc: int, head: str, rdzv_id: str) -> str:
    from freetune.launch import rendezvous_args

    args = rendezvous_args(nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=head, rdzv_id=rdzv_id)
    return shlex.join(["torchrun", *args, script, job])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe name, e.g. svg_coder")
    parser.add_argument("--head", required=True, help="HOST:PORT of the first machine (the rendezvous endpoint)")
    parser.add_argument("--nnodes", type=int, default=2, help="machines in the job")
    parser.add_argument("--node-rank", type=int, default=None, help="this machine's number, 0..nnodes-1")
    parser.add_argument("--nproc-per-node", type=int, default=0, help="processes per machine; 0: one per GPU")
    parser.add_argument("--rdzv-id", default=None, help="job id, the same on every machine (default: the recipe)")
    parser.add_argument("--is-host", choices=["auto", "yes", "no"], default="auto",
                        help="whether this machine serves the rendezvous store; auto: torchrun compares --head's "
                             "host with this machine's name (say yes/no when several launchers share a machine)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--embedded", action="store_true", help="tiny local model + bundled sample data (a CPU check)")
    parser.add_argument("--out", default="runs/multihost", help="working folder: train_ddp.py and the run folders")
    parser.add_argument("--prepare", action="store_true", help="only write train_ddp.py, the job file and the data")
    parser.add_argument("--run", action="store_true", help="prepare, then join the job as --node-rank")
    parser.add_argument("--timeout", type=float, default=None, help="stop this host's torchrun after N seconds")
    args = parser.parse_args(argv)

    from scripts.run_recipe import embedded_parameters, parse_parameters

    out = Path(args.out).resolve()
    rdzv_id = args.rdzv_id or args.recipe.replace("_", "-")
    parameters = {}
    if args.embedded:
        parameters = embedded_parameters(args.recipe)
    parameters.setdefault("output_dir", str(out / "runs"))
    parameters.update(parse_parameters(args.parameter))  # relative paths: from this folder, not --out

    if not (args.run or args.prepare):
        flags = " ".join(f"-p {shlex.quote(n)} {shlex.quote(v)}" for n, v in args.parameter)
        flags += " --embedded" if args.embedded else ""
        nproc = args.nproc_per_node or "<GPUs on that machine>"
        print(f"# {args.recipe} on {args.nnodes} machines; {args.head} is machine 0's address and a free port that "
              f"every machine reaches.\n# Same repository checkout and freetune install on each; run from its root.")
        for rank in range(args.nnodes):
            print(f"\n# machine {rank}:")
            print(f"python -m scripts.multihost {args.recipe} --head {args.head} --nnodes {args.nnodes} "
                  f"--node-rank {rank} --rdzv-id {rdzv_id} --out {shlex.quote(args.out)} {flags} --run".replace("  ", " "))
        print("\n# --run prepares (train_ddp.py, the job file, the audited data) and then runs, on machine K:")
        runs = dict(args.parameter).get("output_dir", f"{args.out}/runs")
        print(torchrun_line(f"{args.out}/train_ddp.py", f"{runs}/<run_name>/train_ddp.json",
                            nnodes=args.nnodes, node_rank=0, nproc=nproc, head=args.head,
                            rdzv_id=rdzv_id).replace("--node_rank=0", "--node_rank=K"))
        return 0

    if args.node_rank is None and args.run:
        raise SystemExit("--run needs --node-rank (0 on the first machine, 1 on the second, ...)")
    from freetune.errors import FreetuneError
    from freetune.launch import run_torchrun, visible_gpus

    nproc = args.nproc_per_node or max(visible_gpus(), 1)
    script, job = prepare(args.recipe, parameters, out, nnodes=args.nnodes, nproc=nproc)
    print(f"prepared: {script} and {job}", flush=True)
    if not args.run:
        return 0
    is_host = {"auto": None, "yes": True, "no": False}[args.is_host]
    run_dir = Path(json.loads(job.read_text())["paths"]["run_dir"])
    try:
        run_torchrun(script, job, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.head,
                     rdzv_id=rdzv_id, is_host=is_host, log_dir=run_dir / "torchrun_logs", timeout_s=args.timeout)
    except FreetuneError as exc:
        print(f"FAILED on node {args.node_rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
