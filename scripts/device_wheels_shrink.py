"""Repack a wheel without some of its files, RECORD rewritten to match (pip checks it on install).
Usage: python device_wheels_shrink.py SRC DST --drop REGEX [--drop REGEX] [--keep REGEX]
(a file goes when its path in the wheel fully matches a --drop pattern and no --keep pattern)."""
import argparse
import base64
import hashlib
import re
import zipfile

parser = argparse.ArgumentParser()
parser.add_argument("src")
parser.add_argument("dst")
parser.add_argument("--drop", action="append", required=True)
parser.add_argument("--keep", action="append", default=[])
args = parser.parse_args()
drop = lambda n: (any(re.fullmatch(p, n) for p in args.drop)  # noqa: E731
                  and not any(re.fullmatch(p, n) for p in args.keep))
with zipfile.ZipFile(args.src) as zin, zipfile.ZipFile(args.dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = [n for n in zin.namelist() if not drop(n)]
    record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for n in names:
        if n == record_name:
            continue
        data = zin.read(n)
        zout.writestr(zin.getinfo(n), data, compress_type=zipfile.ZIP_DEFLATED)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    zout.writestr(zin.getinfo(record_name), "\n".join(rows) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    dropped = sorted(n for n in zin.namelist() if drop(n))
    print(f"{args.dst}: dropped {len(dropped)} files", dropped[:4], "..." if len(dropped) > 4 else "")
