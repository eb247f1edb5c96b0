# Prepare the offline GPU machine (Python 3.12, torch+CUDA already there, no package index) to run freetune.
# Usage, from the repository root with .whl/ carried along:  source scripts/device_setup.sh
# Sourced rather than run because the exports must stay in the caller's shell; so no `set -e` (it would
# close that shell) and failures `return 1`, which lets `source scripts/device_setup.sh && ...` stop.
#
# .whl/ holds the packages that machine lacks (trl, peft, datasets, bitsandbytes cut down to its CUDA 13.0
# and CPU libraries, papermill with ipykernel and its jupyter stack, ...), built on a machine with PyPI.

_freetune_device_setup() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

    if ! ls "$root"/.whl/*.whl >/dev/null 2>&1; then
        echo "device_setup: no wheels in $root/.whl; carry .whl/ with the repository" >&2
        return 1
    fi
    # The wheels are cp312 builds; another interpreter would install them and then fail on import.
    if ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        echo "device_setup: python3 is $(python3 -V 2>&1); the wheels in .whl/ need Python 3.12" >&2
        return 1
    fi

    # A separate --target folder instead of the image's site-packages: the image stays untouched, and
    # PYTHONPATH puts our pins (peft 0.21.2 over the image's peft) ahead of what the image has.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$root"/.whl/*.whl || return 1

    # $root on the path so `import freetune` reads the repository as carried, without an install.
    # papermill's kernel inherits this: nbclient starts it as a subprocess with a copy of os.environ, and
    # jupyter_client resolves kernel "python3" to `sys.executable -m ipykernel_launcher` of this same
    # interpreter because ipykernel is importable (unless a python3 kernelspec sits in a jupyter data
    # folder; the check below prints the command it resolved to).
    export PYTHONPATH="/tmp/site:$root"
    export HF_HUB_OFFLINE=1
    # NVLink multicast must stay off on these machines (see the device notes).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

    python3 - <<'EOF' || return 1
import importlib.metadata as md
import sys

import bitsandbytes
import peft
import torch
import transformers
import trl
from jupyter_client.kernelspec import KernelSpecManager
from packaging.version import Version

print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__,
      "| trl", trl.__version__, "| peft", peft.__version__, "| bitsandbytes", bitsandbytes.__version__)
print("cuda devices:", torch.cuda.device_count(), "| peft from", peft.__file__)
# The carried bitsandbytes has only its CUDA 13.0 and CPU libraries; this names the one it loaded.
lib = getattr(bitsandbytes.cextension.lib, "_lib", None)
print("bitsandbytes backend:", bitsandbytes.cextension.BNB_BACKEND, "|", getattr(lib, "_name", "no native library"))
print("papermill python3 kernel:", " ".join(KernelSpecManager().get_kernel_spec("python3").argv[:3]))
# datasets 5.2.0 needs these two from the image; they are too large (pyarrow) or too shared (fsspec) to carry.
if Version(md.version("pyarrow")) < Version("24.0.0") or Version(md.version("fsspec")) > Version("2026.9.0"):
    print("warning: datasets 5.2.0 needs pyarrow>=24 and fsspec<=2026.9.0; the image has pyarrow",
          md.version("pyarrow"), "and fsspec", md.version("fsspec"), file=sys.stderr)
EOF
}

# Last command, so its status is what `source` returns.
_freetune_device_setup && unset -f _freetune_device_setup
