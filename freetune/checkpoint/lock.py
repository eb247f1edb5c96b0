"""One run per run folder. Two runs with one run_name and output_dir used to overwrite each other: the second
replaced the first's prepared data (the first then failed), or both ended "successfully" with the second's
adapter, checkpoints and summary under the first's name.

The run cell (RunConfig.with_paths -> freetune.platform.resolve_paths) takes `<run folder>/.freetune.lock` for the
notebook's kernel (or the script's process) and holds it while that process lives; running that cell again in the same kernel keeps
it. Processes it starts (torchrun's ranks, a papermill kernel's children) work under it: the holder's token is
in their environment. A second run or notebook meets a FreetuneError naming the holder (host, pid, since when)
and the two ways out: stop that run, or pick another run_name.

A lock of a killed run (kill -9, a lost VM) must not stay: the file records host, pid, the process's start time
and a heartbeat, and is stale when
  - an flock can be taken on it (the kernel drops a dead process's locks), where the file system
    supports them (local disks; most NFS);
  - otherwise, on this host, its pid is gone or now belongs to a process started at another time;
  - on another host (a new Colab VM resuming from Drive after the old one vanished) when its heartbeat, written
    every HEARTBEAT_S by the holder, is older than STALE_AFTER_S.
Limits (Google Drive's FUSE mount and other file systems without shared locks): the check is by the file's
content, which Drive syncs between machines with a delay, so two sessions on two machines started within a minute
of each other may both get through; a session started while another one runs is refused, and after a lost VM the
folder is free again STALE_AFTER_S after its last heartbeat.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

from freetune.errors import FreetuneError

LOCK_FILE = ".freetune.lock"
HOLDERS_ENV = "FREETUNE_RUN_LOCK_HOLDERS"  # tokens of the processes above this one that hold run folder locks
HEARTBEAT_S = 60
STALE_AFTER_S = 5 * 60
_held: dict[str, "RunLock"] = {}  # run folder -> this process's lock on it


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it tells a
    live process from a later one that reused its pid. None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_process() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid)}


def _token(owner: dict) -> str:
    return f"{owner['host']}:{owner['pid']}:{owner['started']}"


class RunLock:
    """This process's lock on a run folder (see the module docstring); `release()` gives it up."""

    def __init__(self, path: Path, fd: int | None, owner: dict):
        self.path, self.fd, self.owner = path, fd, owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="freetune-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                _write(self.path, self.fd, {**self.owner, "heartbeat": time.time()})
            except OSError:
                pass  # a disk hiccup: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        _held.pop(str(self.path.parent), None)
        try:
            if self.fd is not None:
                self.path.write_text("")  # released: no owner (the file itself stays, others may hold it open)
                os.close(self.fd)
            else:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _write(path: Path, fd: int | None, record: dict) -> None:
    data = json.dumps(record).encode()
    if fd is None:
        path.write_bytes(data)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "pid" in record else None


def _holder_alive(record: dict, fcntl_works: bool) -> bool:
    """Whether the recorded holder still runs (see the module docstring)."""
    if record.get("host") == socket.gethostname():
        if fcntl_works:
            return False  # it would hold the fcntl lock we just took
        return _pid_alive(record["pid"]) and _start_time(record["pid"]) == record.get("started")
    return time.time() - float(record.get("heartbeat", 0)) < STALE_AFTER_S


def _try_fcntl(fd: int) -> bool | None:
    """True: locked; False: another live process holds it; None: this file system has no such locks."""
    try:
        import fcntl

        # flock, not lockf: a POSIX lock is dropped when the process closes any descriptor of the file (reading
        # it again would do); flock belongs to this descriptor alone, which children do not inherit.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except ImportError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        return None  # ENOLCK, EINVAL, ENOTSUP: FUSE mounts (Drive) and others


def refusal(run_dir: Path, record: dict | None) -> str:
    if record:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("acquired", 0)))
        who = f"process {record['pid']} on host {record.get('host')!r}, since {since}"
    else:
        who = "another process on this machine"
    return (f"Another run is using the run folder {run_dir} ({who}): two runs in one folder overwrite each other's "
            f"data, checkpoints and adapter. Either wait for it to end, or stop it (a notebook holds its run folder "
            f"until its kernel stops: restart or shut down that notebook's kernel), or set run_name to another name "
            f"for this run. A run that was killed does not keep the folder: its lock is recognised as stale.")


def acquire(run_dir: str | Path) -> RunLock | None:
    """Take the run folder for this process (again: a no-op). None when a process above this one holds it (this
    is one of its torchrun ranks or children). Raises FreetuneError when another live run holds it."""
    run_dir = Path(run_dir).resolve()
    if str(run_dir) in _held:
        return _held[str(run_dir)]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    record = _read(path)
    if record and _token(record) in os.environ.get(HOLDERS_ENV, "").split():
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl_state = _try_fcntl(fd)
    if fcntl_state is False:
        os.close(fd)
        raise FreetuneError(refusal(run_dir, _read(path)))
    if fcntl_state is None:
        os.close(fd)
        fd = None
    record = _read(path)
    if record and _holder_alive(record, fcntl_works=fcntl_state is True):
        if fd is not None:
            os.close(fd)
        raise FreetuneError(refusal(run_dir, record))
    owner = {**this_process(), "acquired": time.time()}
    _write(path, fd, {**owner, "heartbeat": time.time()})
    token = _token(owner)
    holders = os.environ.get(HOLDERS_ENV, "").split()
    if token not in holders:
        os.environ[HOLDERS_ENV] = " ".join([*holders, token])
    lock = RunLock(path, fd, owner)
    _held[str(run_dir)] = lock
    return lock
