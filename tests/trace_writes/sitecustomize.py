"""For the tests that prove only rank 0 writes: with FREETUNE_TRACE_WRITES=<run folder> and this folder on PYTHONPATH
(tests/conftest.py's trace_writes), every torchrun rank records the files it opens for writing, renames, makes or
removes under that folder, and says at exit: "rank R wrote N file(s) under the run folder: [...]". Python-level opens,
renames and mkdirs are seen (an audit hook); writes made inside native code are not."""

import atexit
import os
import sys


def _trace(root: str) -> None:
    root = os.path.realpath(root)
    paths: set[str] = set()

    def note(path) -> None:
        try:
            paths.add(os.path.realpath(os.fsdecode(path)))
        except (TypeError, ValueError):
            return

    def hook(event: str, args) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing:
                note(args[0])
        elif event in ("os.rename", "os.mkdir", "os.remove", "shutil.rmtree") and args:
            note(args[0])

    def report() -> None:
        mine = sorted(os.path.relpath(p, root) for p in paths if p.startswith(root + os.sep))
        print(f"rank {os.environ.get('RANK', '0')} wrote {len(mine)} file(s) under the run folder: {mine}", flush=True)

    sys.addaudithook(hook)
    atexit.register(report)


if os.environ.get("FREETUNE_TRACE_WRITES") and "LOCAL_RANK" in os.environ:  # a rank, not a launcher or a kernel
    _trace(os.environ["FREETUNE_TRACE_WRITES"])
