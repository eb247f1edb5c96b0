"""Outgrowing one GPU (issue 10): two hosts in one torchrun job, and the FSDP-QLoRA path, checked on a CPU.

Two hosts: two `python -m scripts.multihost --run` launchers on this machine, each with its own working folder (its own
"disk"), each preparing the job from the generated Kaggle notebook (svg_coder, tiny Qwen2 model, bundled sample)
and starting torchrun with --nnodes=2 and a c10d rendezvous on a free loopback port (1 process per host, gloo).
Nothing is mocked: real torchrun agents, a real rendezvous, real training through the notebook's train_ddp.py.

FSDP: accelerate's FSDP plugin refuses a machine without an accelerator, so the Trainer's FSDP run is checked on
GPUs (scripts/fsdp_check.py, reports/gpu/fsdp_check.json). Here: the model that freetune.model loads for layout
"fsdp" is read by rank 0 alone (rank 1 builds the same modules without the weights: one copy in host memory),
sharded by torch's FSDP over 2 CPU processes with the Trainer's wrap policy, and trains exactly like one process
(tests/fsdp_driver.py); the plan picks FSDP from the memory estimate; the Trainer gets FSDP1 settings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, trace_writes
from proctree import process_tree, send_signal

pytestmark = pytest.mark.slow

MULTIHOST = [sys.executable, "-m", "scripts.multihost"]  # from the repository root, as docs/distributed.md runs it
RANK_LINE = re.compile(r"node (\d+) of 2 \(.*?\): global rank (\d+) of 2, local rank 0")
KILL_DEADLINE_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Host:
    """One machine's launcher: python -m scripts.multihost --run with its own working folder and log."""

    def __init__(self, tmp: Path, node_rank: int, port: int, *params: tuple[str, str]):
        self.out = tmp / f"host{node_rank}"
        self.log = tmp / f"host{node_rank}.log"
        cmd = [*MULTIHOST, "svg_coder", "--embedded", "--head", f"127.0.0.1:{port}",
               "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1", "--rdzv-id", "test-job",
               # Both launchers share one machine, so torchrun cannot tell from the endpoint's name which of
               # them serves the rendezvous store: say it.
               "--is-host", "yes" if node_rank == 0 else "no", "--out", str(self.out), "--run"]
        for name, value in params:
            cmd += ["-p", name, value]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **trace_writes(self.run_dir),
               "FREETUNE_COLLECTIVE_TIMEOUT_S": "60"}
        # Each launcher runs in its own folder (its own relative paths): the repository root on PYTHONPATH stands
        # for running from there.
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
        self._file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=tmp)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._file.flush()

    @property
    def run_dir(self) -> Path:
        return self.out / "runs" / "svg-coder"

    def rank_log(self) -> str:
        logs = sorted(self.run_dir.glob("torchrun_logs/**/attempt_0/0/stdout.log"))
        assert logs, f"no rank log under {self.run_dir}:\n{self.text()[-3000:]}"
        return logs[-1].read_text(errors="replace")

    def kill_tree(self) -> None:
        """SIGKILL the launcher and everything under it at once, like a machine that vanishes."""
        tree = process_tree(self.proc.pid)
        for pid in tree:
            send_signal(pid, signal.SIGSTOP)
        for pid in tree:
            send_signal(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill_tree()
        self._file.close()


@pytest.fixture
def hosts(tmp_path):
    started: list[Host] = []

    def start(*params):
        port = free_port()
        started.extend(Host(tmp_path, rank, port, *params) for rank in (0, 1))
        return started

    yield start
    for host in started:
        host.close()


def test_two_hosts_train_as_one_job_and_only_global_rank_0_writes(hosts, tiny_model_dir):
    both = hosts(("max_steps", "4"), ("save_steps", "2"))
    codes = [host.wait(timeout=900) for host in both]
    assert codes == [0, 0], "\n\n".join(host.text()[-3000:] for host in both)
    for host in both:
        assert "This host's 1 rank(s) of a 2-host job finished" in host.text()

    # Every host's log says which node and which global / local rank it is; together they are one job.
    placed = {}
    for host in both:
        log = host.rank_log()
        match = RANK_LINE.search(log)
        assert match, log[-2000:]
        placed[host] = (int(match.group(1)), int(match.group(2)))
    assert sorted(node for node, _ in placed.values()) == [0, 1]
    assert sorted(rank for _, rank in placed.values()) == [0, 1]

    # The LoRA weights agree on both hosts after training.
    checksums = [re.findall(r"rank \d: trainable-weights checksum (\w+)", host.rank_log()) for host in both]
    assert checksums[0] and checksums[0] == checksums[1], checksums

    # Only the host holding global rank 0 wrote: the adapter, the complete checkpoints, the summary.
    writer = next(host for host, (_, rank) in placed.items() if rank == 0)
    other = next(host for host in both if host is not writer)
    assert (writer.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    markers = sorted(p.parent.name for p in writer.run_dir.glob("checkpoints/checkpoint-*/freetune_complete.json"))
    assert markers == ["checkpoint-2", "checkpoint-4"]
    summary = json.loads((writer.run_dir / "reports" / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert not list(other.run_dir.glob("adapter/*")), "the host without global rank 0 wrote an adapter"
    assert not list(other.run_dir.glob("checkpoints/checkpoint-*"))
    assert not (other.run_dir / "reports" / "run_summary.json").exists()
    assert "rank 1 wrote 0 file(s)" in other.rank_log(), other.rank_log()[-2000:]
    wrote0 = next(l for l in writer.rank_log().splitlines() if l.startswith("rank 0 wrote"))
    assert "adapter" in wrote0  # the tracer does see rank 0's writes


def test_killing_one_host_fails_the_whole_job_quickly(hosts, tiny_model_dir):
    first, second = hosts(("max_steps", "200"), ("save_steps", "100"))
    # Wait until the job trains (the step lines come from global rank 0, on either host).
    deadline = time.time() + 600
    while not any(re.search(r"step\s+1/200", host.text()) for host in (first, second)):
        assert time.time() < deadline, first.text()[-2000:] + second.text()[-2000:]
        assert first.proc.poll() is None and second.proc.poll() is None, first.text()[-2000:] + second.text()[-2000:]
        time.sleep(0.5)
    second.kill_tree()
    killed_at = time.time()
    code = first.wait(timeout=KILL_DEADLINE_S + 30)
    elapsed = time.time() - killed_at
    print(f"the surviving host's launcher exited {code} {elapsed:.1f} s after the other host was killed")
    assert code != 0, first.text()[-3000:]
    assert elapsed < KILL_DEADLINE_S, f"the surviving host needed {elapsed:.0f} s to give up"
    assert "FAILED on node 0" in first.text(), first.text()[-3000:]


def test_fsdp_loads_once_shards_the_4bit_model_and_trains_like_one_process(tmp_path):
    from freetune.fixtures import cached_tiny_model

    # Wider than the usual tiny model (hidden 256: ~40 M parameters, 153 MiB in fp32, mostly the embedding), so
    # that the weights stand out of a process's memory noise.
    model_dir = cached_tiny_model(hidden_size=256)
    driver = REPO / "tests" / "fsdp_driver.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(driver), str(model_dir), "fsdp", str(tmp_path)],
                             capture_output=True, text=True, env=env, timeout=600)
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    # The recipe's usual path (uint8 storage, fp32 norms) in one process on all the rows.
    plain = subprocess.run([sys.executable, str(driver), str(model_dir), "plain", str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=600)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("fsdp-rank*.json"))]
    fsdp = ranks[0]
    one = json.loads((tmp_path / "plain-rank0.json").read_text())
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    # One copy of the weights in host memory: rank 0 read and quantised them, rank 1 built the same modules
    # without reading them (its parameters got rank 0's values by broadcast, after loading). Rank 1's own growth while
    # loading (modules imported, allocator arenas) measured up to 23 MiB on a 2-core CI machine, of 153 MiB of weights.
    weights_mib = one["total"] * 4 / 2**20
    assert ranks[0]["load_rss_mib"] > 0.6 * weights_mib, ranks
    assert ranks[1]["load_rss_mib"] < 0.25 * weights_mib, ranks
    # 4-bit weights stored in the compute dtype (FSDP shards floating point only); each rank holds half.
    assert fsdp["quantized"] == {"Params4bit": "torch.float32"} and one["quantized"] == {"Params4bit": "torch.uint8"}
    assert all(r["held"] <= 0.55 * r["total"] for r in ranks), ranks
    # Same losses, step after step: the broadcast weights, the sharded 4-bit forward, the reduced gradients and
    # the updates are right.
    assert fsdp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert fsdp["losses"][-1] < fsdp["losses"][0]


def test_the_plan_shards_with_fsdp_when_one_copy_per_gpu_does_not_fit():
    from freetune.errors import FreetuneError
    from freetune.plan import GPU, Hardware, make_plan

    t4x2 = Hardware(gpus=[GPU("Tesla T4", (7, 5), 14.7)] * 2, arch_list=["sm_75"])
    roomy = make_plan(t4x2, model_shape="qwen3-8b", max_length=1024)
    assert roomy.layout.kind == "ddp" and "DDP" in roomy.reasons["layout"]
    tight = make_plan(t4x2, model_shape="qwen3-8b", max_length=1024, memory_budget_gib=7)
    assert tight.layout.kind == "fsdp" and tight.layout.world_size == 2
    assert "FSDP, because one full copy per GPU (DDP) needs" in tight.reasons["layout"]
    assert tight.memory.estimate.settings["shards"] == 2 and tight.memory.estimate.fits, tight.memory.estimate.breakdown()
    assert "fsdp x 2" in tight.table()
    one_t4 = Hardware(gpus=[GPU("Tesla T4", (7, 5), 14.7)], arch_list=["sm_75"])
    # Nothing to shard over, and even one short row does not fit 6 GiB: refused before anything is downloaded.
    with pytest.raises(FreetuneError, match=r"cannot train on this GPU.*set by memory_budget_gib"):
        make_plan(one_t4, model_shape="qwen3-8b", memory_budget_gib=6)
    # One process may keep the 1.16 GiB embedding table in host RAM (DDP's ranks may not): 7 GiB then fits one GPU.
    seven = make_plan(one_t4, model_shape="qwen3-8b", memory_budget_gib=7)
    assert seven.layout.kind == "single" and seven.memory.embeddings_on_host and seven.memory.estimate.fits and not seven.warnings
    # DDP forced where only FSDP fits (each rank keeps the whole embedding table on its GPU): refused up front.
    with pytest.raises(FreetuneError, match=r"cannot train on this GPU.*set by memory_budget_gib"):
        make_plan(t4x2, model_shape="qwen3-8b", layout="ddp", memory_budget_gib=7)
    with pytest.raises(FreetuneError, match="layout must be one of"):
        make_plan(t4x2, layout="zero3")


def test_the_trainer_gets_fsdp1_settings_and_a_cpu_run_is_refused(tmp_path):
    from freetune.errors import FreetuneError
    from freetune.platform import Paths
    from freetune.plan import Plan
    from freetune.sft_config import make_config

    run = tmp_path / "run"
    paths = Paths(platform="local", run_dir=str(run), checkpoints=str(run / "c"), adapter=str(run / "a"),
                  data=str(run / "d"), reports=str(run / "r"))
    # A GPU plan (fp32 so that TrainingArguments accepts it on this CPU-only machine).
    plan = Plan.build(device="cuda", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                layout="fsdp", world_size=2)
    config = make_config(paths, plan, max_steps=4, micro_batch=1, grad_accum=1, learning_rate=1e-4, max_length=64,
                         optimizer="adamw_torch")
    args = config.fsdp_plugin_args
    assert config.fsdp and args["fsdp_version"] == 1
    assert args["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and args["use_orig_params"] is False
    assert args["sync_module_states"] is True and args["state_dict_type"] == "FULL_STATE_DICT"
    assert args["reshard_after_forward"] == "full_shard"
    cpu = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa", layout="fsdp")
    with pytest.raises(FreetuneError, match="needs GPUs"):
        make_config(paths, cpu, max_steps=4, micro_batch=1, grad_accum=1, learning_rate=1e-4, max_length=64)


def test_multihost_prints_the_commands_for_two_machines():
    result = subprocess.run([*MULTIHOST, "home_assistant", "--head", "10.0.0.1:29500", "-p", "max_steps", "50"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for rank in (0, 1):
        assert (f"python -m scripts.multihost home_assistant --head 10.0.0.1:29500 --nnodes 2 --node-rank {rank} "
                f"--rdzv-id home-assistant") in out
    assert ("torchrun --nnodes=2 --node_rank=K '--nproc_per_node=<GPUs on that machine>' --rdzv_backend=c10d "
            "--rdzv_endpoint=10.0.0.1:29500 --rdzv_id=home-assistant runs/multihost/train_ddp.py") in out
