"""The torchrun launcher the Kaggle notebooks use (real torchrun, 2 processes, gloo on the CPU), and the CPU binding
of GPU ranks."""

import json
import os
import subprocess
import sys
import time

import pytest

from freetune.distributed import cpus_for_local_rank, physical_cores
from freetune.errors import FreetuneError
from freetune.launch import rank0_lines, run_torchrun

SCRIPT = '''
import os, sys, time
import freetune
ctx = freetune.distributed.init(timeout_s=60)
print(f"hello from rank {ctx.rank} of {ctx.world_size} on {ctx.device} ({ctx.backend})", flush=True)
if ctx.rank == 0:  # a line printed in two parts, then blank lines and a line after them
    print("Loading the model ...", end="", flush=True)
    time.sleep(0.5)
    print(" done", flush=True)
    print("\\n\\nafter the blank lines", flush=True)
if ctx.rank == 1 and sys.argv[1] == "fail":
    raise ValueError("boom on rank 1")
if ctx.rank == 1 and sys.argv[1] == "freetune-error":
    try:
        int("x")
    except ValueError as exc:
        raise freetune.FreetuneError("Set `dataset` to a file that exists.") from exc
freetune.distributed.barrier()
freetune.distributed.cleanup()
'''


def test_two_ranks_run_and_only_rank_0_is_streamed(tmp_path, capfd):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    run_torchrun(script, "ok", nproc=2, log_dir=tmp_path / "logs")
    out = capfd.readouterr().out
    assert "hello from rank 0 of 2 on cpu (gloo)" in out
    assert "hello from rank 1" not in out  # other ranks go to their log files only
    rank1 = next((tmp_path / "logs").glob("**/attempt_0/1/stdout.log")).read_text()
    assert "hello from rank 1 of 2" in rank1
    assert "All 2 ranks finished" in out
    # Rank 0's lines as it printed them: no torchrun prefix or banner, a line printed in parts whole, one blank line.
    assert "[default0]" not in out and "OMP_NUM_THREADS" not in out
    assert "\nLoading the model ... done\n\nafter the blank lines\n" in out


def test_rank0_lines_strip_the_tee_prefix_and_keep_torchrun_s_own_lines_apart():
    import io

    stream = ["[default0]:\n", "[default0]:Loading ...[default0]: done\n", "W1201 torchrun says\n",
              "[default0]:Layout: 2 processes  \n", "[default0]:\n", "[default0]:\n", "[default0]:step 1\n"]
    launcher = io.StringIO()
    assert list(rank0_lines(stream, launcher)) == ["Loading ... done", "Layout: 2 processes", "", "step 1"]
    assert launcher.getvalue() == "W1201 torchrun says\n"


def test_a_failing_rank_fails_the_cell_fast_with_its_error(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    start = time.time()
    with pytest.raises(FreetuneError) as info:
        run_torchrun(script, "fail", nproc=2, log_dir=tmp_path / "logs")
    assert time.time() - start < 60, "a dead rank must end the job quickly, not after a collective timeout"
    message = str(info.value)
    assert "rank 1 reported" in message and "ValueError: boom on rank 1" in message


def test_a_rank_s_freetune_error_comes_back_as_its_message(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    with pytest.raises(FreetuneError) as info:
        run_torchrun(script, "freetune-error", nproc=2, log_dir=tmp_path / "logs")
    message = str(info.value)
    assert message.endswith("rank 1 reported:\nSet `dataset` to a file that exists."), message
    assert "Traceback" not in message and "ValueError" not in message


# ---- CPU binding of GPU ranks (freetune.distributed.bind_cpus) ----------------------------------------------


def test_each_local_rank_gets_whole_cores_of_its_own():
    # 4 cores with two hyper-threads each, numbered as Linux numbers them (siblings 16 apart).
    cores = [[0, 16], [1, 17], [2, 18], [3, 19]]
    shares = [cpus_for_local_rank(cores, rank, 2) for rank in range(2)]
    assert shares == [{0, 16, 1, 17}, {2, 18, 3, 19}]  # siblings stay together: no rank shares a core
    three = [cpus_for_local_rank(cores[:3], rank, 2) for rank in range(2)]
    assert three == [{0, 16, 1, 17}, {2, 18}]  # the first ranks take the core left over
    assert cpus_for_local_rank(cores[:1], 0, 2) is None  # fewer cores than ranks: no binding
    assert cpus_for_local_rank(cores, 0, 1) is None  # one process: nothing to keep apart


def test_physical_cores_cover_every_allowed_cpu_once():
    allowed = os.sched_getaffinity(0)
    cores = physical_cores(allowed)
    flat = [cpu for core in cores for cpu in core]
    assert sorted(flat) == sorted(allowed) and len(flat) == len(set(flat))


BIND_SCRIPT = '''
import json, os, sys, threading
from freetune.distributed import DistContext, bind_cpus
rank = int(sys.argv[1])
stop = threading.Event()
early = threading.Thread(target=stop.wait)  # a thread that exists before the binding, as CUDA's and NCCL's may
early.start()
ctx = DistContext(rank=rank, local_rank=rank, world_size=2, backend="nccl", device=sys.argv[2])
bound = bind_cpus(ctx)
threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({"bound": sorted(bound) if bound else None, "threads": threads}))
'''


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to give 2 ranks one each")
def test_gpu_ranks_are_bound_to_disjoint_cpus_with_all_their_threads(tmp_path):
    script = tmp_path / "bind.py"
    script.write_text(BIND_SCRIPT)
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    env.pop("FREETUNE_CPU_BINDING", None)

    def run(rank, device="cuda:0", **extra):
        out = subprocess.run([sys.executable, str(script), str(rank), device], env={**env, **extra},
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    first, second = run(0), run(1, "cuda:1")
    assert first["bound"] and second["bound"] and not set(first["bound"]) & set(second["bound"])
    assert set(first["bound"]) | set(second["bound"]) == os.sched_getaffinity(0)
    for result in (first, second):  # every thread, the one started before the binding too
        assert len(result["threads"]) >= 2
        assert all(cpus == result["bound"] for cpus in result["threads"].values())
    everything = sorted(os.sched_getaffinity(0))
    off = run(0, FREETUNE_CPU_BINDING="off")  # the switch leaves the OS to place the process
    assert off["bound"] is None and all(cpus == everything for cpus in off["threads"].values())
    cpu_rank = run(0, "cpu")  # gloo ranks on a CPU (CI): not bound, they need every core they can get
    assert cpu_rank["bound"] is None
