"""One script for 1 or N processes: read torchrun's RANK / LOCAL_RANK / WORLD_SIZE, or run alone.

Under torchrun each rank loads a full copy of the 4-bit model on its own GPU (DDP), never rewriting
CUDA_VISIBLE_DEVICES: every rank sees all GPUs and picks `cuda:LOCAL_RANK`. Only the main process (global
rank 0) writes files. `cleanup()` waits for every rank (`barrier()`) and then destroys the process group, so
the job neither hangs at the end nor warns that destroy_process_group() was not called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

# A dead rank must end the job within minutes, not after NCCL's default 30-minute (10 for gloo) wait.
COLLECTIVE_TIMEOUT_S = int(os.environ.get("FREETUNE_COLLECTIVE_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str | None     # "nccl", "gloo", or None when running alone
    device: str             # "cuda:N" or "cpu"
    node: int = 0           # this host's place among the hosts (torchrun's GROUP_RANK; 0 on one host)
    nodes: int = 1          # hosts in the job (WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def context() -> DistContext:
    """This process's place in the job, from torchrun's environment (rank 0 of 1 when alone)."""
    import torch

    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and os.environ.get("FREETUNE_FORCE_CPU") != "1"
    backend = None if world_size == 1 else ("nccl" if cuda else "gloo")
    node = int(os.environ.get("GROUP_RANK", 0))
    nodes = max(world_size // max(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), 1), 1)
    return DistContext(rank, local_rank, world_size, backend, f"cuda:{local_rank}" if cuda else "cpu", node, nodes)


def physical_cores(cpus: set[int]) -> list[list[int]]:
    """The CPUs in `cpus` grouped by physical core (hyper-threads of one core together), in core order. Read from
    sysfs; a CPU whose topology cannot be read counts as a core of its own."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = _cpu_list(open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read())
        except (OSError, ValueError):
            siblings = {cpu}
        cores.setdefault(min(siblings | {cpu}), []).append(cpu)
    return [cores[k] for k in sorted(cores)]


def _cpu_list(text: str) -> set[int]:
    """sysfs' "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpus_for_local_rank(cores: list[list[int]], local_rank: int, local_world: int) -> set[int] | None:
    """An equal, disjoint share of whole physical cores for each process on this host (the first ranks take one
    more when they do not divide evenly); None when there are fewer cores than processes."""
    if local_world < 2 or len(cores) < local_world:
        return None
    per, extra = divmod(len(cores), local_world)
    start = local_rank * per + min(local_rank, extra)
    share = cores[start:start + per + (1 if local_rank < extra else 0)]
    return {cpu for core in share for cpu in core}


def bind_cpus(ctx: DistContext) -> set[int] | None:
    """Keep each GPU process on its own physical cores (set FREETUNE_CPU_BINDING=off to leave the OS to place them).

    Why: a QLoRA step of a small model is bound by the host (Python, kernel launches; the GPU is busy for under
    half of it), so each rank's speed is its main thread's speed. Left alone, the scheduler may put the two ranks'
    busy threads on the two hyper-threads of one core, or move them around; the slower rank then makes the other
    wait at every gradient all-reduce. Only for CUDA ranks, all on one host, with at least one core each.
    Measured once on 2 x H200 (32 vCPUs): 45,759 tokens/s bound, 39,761 not (reports/gpu/ddp_cpu_binding.json,
    ddp_no_cpu_binding.json), within the spread between calls; a Python loop ran ~30% faster in processes bound
    to 16 CPUs each than unbound."""
    if (os.environ.get("FREETUNE_CPU_BINDING", "cores") == "off" or not ctx.distributed
            or not ctx.device.startswith("cuda") or not hasattr(os, "sched_setaffinity")):
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    cpus = cpus_for_local_rank(physical_cores(os.sched_getaffinity(0)), ctx.local_rank, local_world)
    if not cpus:
        return None
    # Every thread this process already has (sched_setaffinity(0) moves the calling thread only); the threads
    # started later (autograd, NCCL) inherit it.
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:
            pass
    return cpus


def init(timeout_s: int = COLLECTIVE_TIMEOUT_S) -> DistContext:
    """Join the process group (when under torchrun with >1 process) with a finite collective timeout."""
    import torch
    import torch.distributed as dist

    ctx = context()
    bound = bind_cpus(ctx)
    if ctx.device.startswith("cuda"):
        torch.cuda.set_device(ctx.local_rank)
    if ctx.distributed and not dist.is_initialized():
        kwargs = {"device_id": torch.device(ctx.device)} if ctx.backend == "nccl" else {}
        dist.init_process_group(ctx.backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    if ctx.distributed:
        # Every rank says where it is: with several hosts each host keeps its own logs, and these lines are how
        # a failure in one of them is placed. Under the c10d rendezvous torchrun numbers the hosts itself
        # (GROUP_RANK), whatever --node_rank said, so the host that holds global rank 0 (the one that writes)
        # is known only from here.
        import socket

        writes = " (global rank 0: the only one that writes)" if ctx.is_main else ""
        where = f", CPUs {_cpu_ranges(bound)}" if bound else ""
        print(f"node {ctx.node} of {ctx.nodes} ({socket.gethostname()}): global rank {ctx.rank} of "
              f"{ctx.world_size}, local rank {ctx.local_rank} on {ctx.device}{where} ({ctx.backend}){writes}",
              flush=True)
    return ctx


def _cpu_ranges(cpus: set[int]) -> str:
    """{0, 1, 2, 16, 17, 18} -> "0-2,16-18"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    """Wait for every rank, then leave the process group (no hang at the end, no leaked-group warning)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """print() on the main process only, so N ranks do not repeat every line."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def print_layout(ctx: DistContext, micro_batch: int, grad_accum: int, trainable: int, total: int) -> None:
    """Rank 0 shows how the job is laid out, so a second GPU sitting idle is visible at once."""
    if not ctx.is_main:
        return
    import torch

    if ctx.device.startswith("cuda"):
        names = [f"rank {r} -> cuda:{r % max(torch.cuda.device_count(), 1)}" for r in range(ctx.world_size)]
        where = f"{ctx.world_size} process(es) on GPU(s): " + ", ".join(names)
    else:
        where = f"{ctx.world_size} process(es) on the CPU" + (f" ({ctx.backend})" if ctx.backend else "")
    print(f"Layout: {where}\n"
          f"  per-process batch {micro_batch} x accumulation {grad_accum} x {ctx.world_size} process(es) = "
          f"global batch {micro_batch * grad_accum * ctx.world_size}\n"
          f"  trainable parameters {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%)",
          flush=True)


def trainable_checksum(model) -> str:
    """A short digest of the trainable (LoRA) weights: identical on every rank after a correct DDP run."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def check_replicas_agree(model) -> str:
    """Every rank prints its LoRA checksum; raise if the replicas drifted apart (a broken DDP setup)."""
    import torch.distributed as dist

    ctx = context()
    mine = trainable_checksum(model)
    print(f"rank {ctx.rank}: trainable-weights checksum {mine}", flush=True)
    if ctx.distributed and dist.is_initialized():
        everyone: list = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        if len(set(everyone)) != 1:
            raise RuntimeError(f"LoRA weights differ between ranks after training: {everyone}. The replicas were "
                               f"not kept in sync; do not use this adapter.")
    return mine
