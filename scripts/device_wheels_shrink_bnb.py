import base64, hashlib, re, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
keep_so = {"libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"}
drop = lambda n: re.fullmatch(r"bitsandbytes/libbitsandbytes_.*\.so", n) and n.split("/")[-1] not in keep_so
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
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
    print("dropped:", sorted(n for n in zin.namelist() if drop(n)))
