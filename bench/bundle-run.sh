#!/usr/bin/env bash
# The GPU bundle's entry (`make gpu-bundle` copies this file to .gpu-bundle/run.sh): checks the
# commit the bundle was made from on this node, with this node's own Python and PyTorch 2.11.0,
# no Rust and no network needed.
#
#   run.sh --next [--out DIR]   the first tier the committed table (committed-gpu-check.json) lacks
#   run.sh --tier N [--budget SECONDS] [--only PATTERN]... [--out DIR] [--resume-from TABLE] [--device cpu] [gpu_check.py's flags]
#   run.sh --tiers              the tiers, their expected time here, and which the committed table has
#   run.sh --libraries          where each bundled binary's libraries come from here, then exit
#
# --out DIR (default results/ under the current folder) gets gpu-check.md and .json, rewritten
# after every check; --budget (default 480 s) bounds the whole run; --resume-from a table runs
# only what it did not finish. The Python is $TORCH_PYTHON, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${TORCH_PYTHON:-python3}"
die() { echo "run.sh: $*" >&2; exit 2; }

out="results"
args=()
libraries=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) [[ $# -ge 2 ]] || die "--out needs a folder"; out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --libraries) libraries=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

# The node's PyTorch: its version (tch binds exactly 2.11.0) and its lib/ folder.
command -v "$python" >/dev/null 2>&1 || die "no $python on PATH (set TORCH_PYTHON to a Python with PyTorch 2.11.0)"
info="$("$python" -c 'import os, torch; print(torch.__version__); print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)" \
    || die "$python cannot import torch (set TORCH_PYTHON to a Python with PyTorch 2.11.0)"
version="$(sed -n 1p <<<"$info")"; torch_lib="$(sed -n 2p <<<"$info")"
[[ "${version%%+*}" == 2.11.0 ]] || die "$python has PyTorch $version; these binaries need 2.11.0 (tch 0.24)"

# The payload, unpacked once per payload (beside the bundle, or in $TMPDIR where it is read-only).
id="$(cat "$here/PAYLOAD_ID" 2>/dev/null)" || die "$here is not a GPU bundle (no PAYLOAD_ID): make gpu-bundle"
unpacked="$here/.unpacked-$id"
if [[ ! -d "$unpacked" ]]; then
    [[ -w "$here" ]] || unpacked="${TMPDIR:-/tmp}/gpu-bundle-$id"
    if [[ ! -d "$unpacked" ]]; then
        "$python" - "$here/payload.tar.gz" "$unpacked" <<'PY' || die "cannot unpack $here/payload.tar.gz"
import os, sys, tarfile
payload, dest = sys.argv[1:]
partial = dest + f".partial-{os.getpid()}"
with tarfile.open(payload) as tar:
    tar.extractall(partial, filter="tar")
os.rename(partial, dest)
PY
    fi
fi

# The node's torch first, then the bundle's libraries; the bundle's Open MPI, relocated, and its
# PMIx; no complaints about Open MPI plugins left out of the bundle (network hardware).
# The node's own environment is kept for the Python references (PyTorch, Lightning): Lightning
# imports the node's mpi4py, which must not find the bundle's Open MPI (it aborted so on an H100).
export COURSE_NODE_LD_LIBRARY_PATH="${LD_LIBRARY_PATH-}" COURSE_NODE_PATH="$PATH"
export LD_LIBRARY_PATH="$torch_lib:$unpacked/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$unpacked/openmpi" PATH="$unpacked/openmpi/bin:$PATH"
export PMIX_INSTALL_PREFIX="$unpacked/openmpi/pmix" PMIX_MCA_mca_base_component_path="$unpacked/openmpi/pmix/lib/pmix"
export OMPI_MCA_mca_base_component_show_load_errors=0
export TORCH_PYTHON="$python"

# Every library each binary needs must be found: one line naming the first that is not.
for b in "$unpacked"/bin/* "$unpacked/openmpi/bin/orterun"; do
    missing="$(ldd "$b" 2>&1 | awk '/not found/ {print $1}' | head -1)"
    [[ -z "$missing" ]] || die "$(basename "$b") needs $missing, which neither this node nor the bundle has"
done
if [[ $libraries == 1 ]]; then
    for b in "$unpacked"/bin/* "$unpacked/openmpi/bin/orterun"; do
        ldd "$b" | awk -v b="$(basename "$b")" '/=>/ {print b ": " $1 " => " $3}'
    done
    exit 0
fi
mkdir -p "$out" || die "cannot create the results folder $out"
exec "$python" "$here/bench/gpu_check.py" --bin "$unpacked/bin" --python "$python" --results "$out" "${args[@]}"
