"""The torchrun launcher the Kaggle notebooks use: real torchrun, 2 processes, gloo on the CPU."""

import time

import pytest

from freetune.errors import FreetuneError
from freetune.launch import run_torchrun

SCRIPT = '''
import os, sys, time
import freetune
ctx = freetune.distributed.init(timeout_s=60)
print(f"hello from rank {ctx.rank} of {ctx.world_size} on {ctx.device} ({ctx.backend})", flush=True)
if ctx.rank == 1 and sys.argv[1] == "fail":
    raise ValueError("boom on rank 1")
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


def test_a_failing_rank_fails_the_cell_fast_with_its_error(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    start = time.time()
    with pytest.raises(FreetuneError) as info:
        run_torchrun(script, "fail", nproc=2, log_dir=tmp_path / "logs")
    assert time.time() - start < 60, "a dead rank must end the job quickly, not after a collective timeout"
    message = str(info.value)
    assert "rank 1 reported" in message and "ValueError: boom on rank 1" in message
