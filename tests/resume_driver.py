"""The training path a recipe runs (freetune.model + freetune.train), as a script tests/test_resume.py can kill.

    python tests/resume_driver.py job.json                                        # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/resume_driver.py job.json   # DDP, gloo

job.json: {"model_dir", "run_dir", "max_steps", "save_steps", and optionally "time_budget_min", "hub_root",
"hub_retry_s", "kill_at", "pid_dir", "optimizer" (the Trainer's optim; "adamw_8bit" runs bitsandbytes' 8-bit AdamW on
the CPU, which its CPU backend can), "one_launch" (false: bitsandbytes' optimizer as it comes, not
freetune.speed.optimizer's), "lora_rank"}.
`hub_root` (optional) turns on Hub sync against LocalHub, a stand-in for huggingface_hub.HfApi that keeps the
"repo" in a folder (the real Hub cannot be reached from tests). `kill_at` {"phase": ..., "nth": k} makes the
process SIGKILL itself the k-th time it reaches that point of a checkpoint save, to hit each point for certain.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

ROWS = 48
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# What a forkserver imports once for tests/test_resume.py (see forked_main).
PRELOAD = ["torch", "transformers.trainer", "trl.trainer.sft_trainer", "peft", "bitsandbytes", "datasets",
           "transformers.models.qwen2.modeling_qwen2", "freetune.model", "freetune.train", "freetune.trainer"]


def synthetic_rows():
    """Short prompt/completion rows (a few tokens each): fast on a CPU, and each row different."""
    from datasets import Dataset

    words = ["red", "green", "blue", "circle", "square", "line", "small", "large", "left", "right", "top", "bottom"]
    rows = []
    for i in range(ROWS):
        a, b, c = words[i % 12], words[(i * 5 + 3) % 12], words[(i * 7 + 1) % 12]
        rows.append({"prompt": f"Draw {a} {b} number {i}:", "completion": f" <svg>{c} {a} {i * 3}</svg>"})
    return Dataset.from_list(rows)


class LocalHub:
    """The methods of huggingface_hub.HfApi that freetune.checkpoint calls, on a local folder. Every call is logged
    (method, RANK, whether an uploaded checkpoint was complete) so the test can check who uploaded what.
    The first upload fails with a message that echoes the token, as a careless HTTP library might."""

    def __init__(self, root: str):
        self.root = Path(root)
        self.log = self.root / "calls.jsonl"

    def _note(self, method: str, **details) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(json.dumps({"method": method, "rank": os.environ.get("RANK", "0"), **details}) + "\n")

    def _repo(self, repo_id: str) -> Path:
        return self.root / "repos" / repo_id

    def create_repo(self, repo_id, *, private=None, exist_ok=False, repo_type=None, **kwargs):
        self._note("create_repo", repo_id=repo_id, private=private)
        self._repo(repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, repo_type=None, commit_message=None, **kw):
        from freetune.checkpoint import check_complete

        complete, why = check_complete(folder_path)
        attempts = sum(1 for line in self.log.read_text().splitlines() if '"upload_folder"' in line)
        self._note("upload_folder", path_in_repo=path_in_repo, complete=complete, why=why)
        if attempts == 0:
            raise ConnectionError(f"503 Service Unavailable (request headers: Authorization: Bearer "
                                  f"{os.environ.get('HF_TOKEN')})")
        # A Hub commit is all-or-nothing: copy aside, then rename into place.
        target = self._repo(repo_id) / path_in_repo
        staging = target.with_name(target.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(folder_path, staging)
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)

    def list_repo_files(self, repo_id, *, repo_type=None, **kwargs):
        repo = self._repo(repo_id)
        return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")
                      if p.is_file() and ".staging" not in p.as_posix())

    def hf_hub_download(self, repo_id, filename, *, repo_type=None, local_dir=None, **kwargs):
        self._note("hf_hub_download", filename=filename)
        destination = Path(local_dir) / filename
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._repo(repo_id) / filename, destination)
        return str(destination)

    def delete_folder(self, path_in_repo, repo_id, *, repo_type=None, commit_message=None, **kwargs):
        self._note("delete_folder", path_in_repo=path_in_repo)
        shutil.rmtree(self._repo(repo_id) / path_in_repo)


def arm_self_kill(phase: str, nth: int) -> None:
    """SIGKILL this process at `phase` the `nth` time this process reaches it (test-only wrapping of the calls a
    checkpoint save makes, in their order: adapter, optimizer + scheduler, trainer state, marker, rotation)."""
    import transformers.trainer as hf_trainer
    from transformers.trainer_callback import TrainerState

    import freetune.checkpoint.marker as ckpt

    def die():
        print(f"driver: self-kill at {phase} #{nth}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_after(owner, name):
        original, calls = getattr(owner, name), [0]

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            calls[0] += 1
            if calls[0] == nth and phase == f"after_{name}":
                die()
            return result

        setattr(owner, name, wrapped)

    kill_after(hf_trainer.Trainer, "save_model")                      # adapter written (first in a save)
    kill_after(hf_trainer.Trainer, "_save_optimizer_and_scheduler")   # + optimizer.pt, scheduler.pt
    kill_after(TrainerState, "save_to_json")                          # + trainer_state.json: all but the marker
    kill_after(ckpt, "write_marker")                                  # marker written, rotation not run yet
    original_discard, discards = ckpt._discard, [0]

    def discard(path):  # rotation renames the old checkpoint aside; killed before it is deleted
        discards[0] += 1
        if discards[0] == nth and phase == "mid_rotation":
            os.replace(path, path.with_name(".deleting-" + path.name))
            die()
        original_discard(path)

    ckpt._discard = discard


def report_optimizer(one_launch: bool) -> None:
    """Print the class of the optimizer FreetuneTrainer.create_optimizer made (one_launch=False: bitsandbytes' own,
    as freetune.speed.optimizer.one_launch leaves it)."""
    import freetune.speed.optimizer as one_launch_optimizer

    original = one_launch_optimizer.one_launch

    def reporting(optimizer):
        optimizer = original(optimizer) if one_launch else optimizer
        flat = sum(len(f.weights) for f in getattr(optimizer, "freetune_flats", ()))
        print(f"driver: optimizer {type(optimizer).__name__}, {flat} weights in flat tensors", flush=True)
        return optimizer

    one_launch_optimizer.one_launch = reporting


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    import transformers

    import freetune
    import freetune.checkpoint  # not (yet) among freetune's lazily loaded submodules
    from freetune.platform import Paths
    from freetune.plan import Plan

    ctx = freetune.distributed.init(timeout_s=60)
    if job.get("pid_dir"):  # outside the run folder: lets the test signal one rank
        Path(job["pid_dir"], f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    if job.get("kill_at"):
        arm_self_kill(job["kill_at"]["phase"], job["kill_at"]["nth"])
    if job.get("hub_retry_s") is not None:
        freetune.checkpoint.HubSync.retry_delays_s = tuple(job["hub_retry_s"])

    run_dir = job["run_dir"]
    paths = Paths.under(run_dir)
    if ctx.is_main:
        paths.make()
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                layout=job.get("layout"),  # "fsdp": the sharded path (tests/test_multihost.py), else DDP/single
                # What make_plan picks under torchrun: a resumed run must take up the balanced order where it was.
                sampler="rank_balanced" if ctx.world_size > 1 else "random")
    tokenizer = freetune.model.load_tokenizer(job["model_dir"])
    # LoRA's A matrices are drawn from torch's global RNG when the adapter is attached, before the Trainer seeds
    # anything: without this, two fresh runs start from different adapters (a resumed run reads them back).
    transformers.set_seed(0)
    model = freetune.model.load_base_model(job["model_dir"], plan, local_rank=ctx.local_rank)
    model, _, _ = freetune.model.attach_lora(model, rank=job.get("lora_rank", 8), alpha=16, dropout=0.0)
    config = freetune.sft_config.make_config(
        paths, plan, max_steps=job["max_steps"], micro_batch=2, grad_accum=1, learning_rate=5e-3, max_length=64,
        optimizer="adamw_torch", logging_steps=1, save_steps=job["save_steps"], save_total_limit=2,
        gradient_checkpointing=True, seed=0)
    if job.get("optimizer"):  # a CPU plan gives PyTorch's AdamW; bitsandbytes 0.50 runs its 8-bit AdamW on CPUs too
        from transformers.training_args import OptimizerNames

        config.optim = OptimizerNames(job["optimizer"])
        report_optimizer(one_launch=job.get("one_launch", True))
    hub_api = LocalHub(job["hub_root"]) if job.get("hub_root") else None
    print("driver: training starts", flush=True)
    summary = freetune.train.train(model, tokenizer, synthetic_rows(), config, plan=plan, paths=paths,
                                   time_budget_min=job.get("time_budget_min", 0),
                                   hub_checkpoint_repo="tester/ckpts" if hub_api else "", hub_api=hub_api)
    print("driver: summary " + json.dumps(summary), flush=True)
    freetune.distributed.cleanup()


def forked_main(job: str, log: str, env: dict) -> None:
    """main() in a process forked from a forkserver that already imported PRELOAD: output to `log`, and the
    environment a fresh process would get (no token unless the test gives one)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    for name in TOKEN_VARS:
        os.environ.pop(name, None)
    os.environ.update(env)
    sys.argv = [__file__, job]
    main()


if __name__ == "__main__":
    main()
