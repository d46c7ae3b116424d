#!/usr/bin/env bash
# `make bench-checkpoint`: what checkpointing costs training, on CPU ranks, for the Transformer of
# `make bench-parallel` (d 256, d_hid 1024, 8 heads, 4 layers, ~9M parameters with Adam's state;
# the real WikiText-2 valid split as training text), NPROC=4 ranks, global batch GLOBAL streams,
# STEPS steps with a checkpoint every EVERY steps, in four layouts (4 data-parallel replicas,
# ZeRO-3 over them, tensor parallel over 4, a 4-stage pipeline), each written as one whole-model
# file through rank 0 (--checkpoint-format whole) and sharded (every rank writes its part; the
# default for the last three). For each: checkpoints taken, the bytes rank 0 copies and writes
# per checkpoint (the whole state, or its own part), training time blocked per checkpoint
# (gathering the state to rank 0, or not, and copying it to host memory; mean and worst), rank
# 0's background write time per checkpoint, and the steady time per step; then one more step
# resumed from the last checkpoint in the same layout: the bytes of the checkpoint rank 0 read
# into memory to resume (a single file: all of it, for every rank; sharded: its part). Rows go to
# results/bench-checkpoint.csv; a table is printed. The ranks share this machine's cores:
# compare the rows with each other, not with a cluster's.
#
#   make bench-checkpoint                        NPROC=4 GLOBAL=16 STEPS=12 EVERY=2 THREADS=1
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NPROC="${NPROC:-4}"; GLOBAL="${GLOBAL:-16}"; STEPS="${STEPS:-12}"; EVERY="${EVERY:-2}"; THREADS="${THREADS:-1}"
bin="${BIN:-target/release}"
csv="results/bench-checkpoint.csv"
# shellcheck source=bench/transformer.sh
source "$root/bench/transformer.sh"
common=("${transformer_flags[@]}" --nproc-per-node "$NPROC" --checkpoint-every "$EVERY")

header="finished_at,layout,ranks,params,files,checkpoints,bytes,blocked_ms_mean,blocked_ms_max,write_ms_mean,step_ms,resume_read_bytes"
if [[ -f "$csv" && "$(head -n 1 "$csv")" != "$header" ]]; then
    sed -i "1s/.*/$header/; 2,\$s/\$/,/" "$csv"  # rows from before the resume column: left empty
fi
PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "$header"  # refuses a link or a FIFO there, before the first run
echo "Transformer d 256, 4 layers, $NPROC CPU ranks, global batch $GLOBAL × 35 tokens, Adam, a checkpoint every $EVERY of $STEPS steps:"
echo "| layout | format | checkpoints | MiB through rank 0 | training blocked per checkpoint, mean / worst (ms) | rank 0's background write per checkpoint (ms) | step (ms) | MiB rank 0 read to resume |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
run() {
    local name="$1"; shift
    for format in whole sharded; do
        rm -rf "$work/results" "$work/ck" "$work/resumed"
        "$@" "${common[@]}" --max-steps "$STEPS" --checkpoint-format "$format" --checkpoint-dir "$work/ck" --results-dir "$work/results" \
            > "$work/log" 2>&1 || { echo "error: $name ($format) failed:" >&2; tail -n 20 "$work/log" >&2; exit 1; }
        "$@" "${common[@]}" --max-steps "$((STEPS + 1))" --resume --checkpoint-format "$format" --checkpoint-dir "$work/ck" \
            --results-dir "$work/resumed" > "$work/log" 2>&1 || { echo "error: $name ($format) resumed failed:" >&2; tail -n 20 "$work/log" >&2; exit 1; }
        report "$name" "$format"
    done
}
report() {
    python3 - "$work/results"/*-cpu.json "$csv" "$1" "$2" "$work/resumed"/*-cpu.json <<'PY'
import json, sys, time
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
d = json.load(open(sys.argv[1]))
csv, name, form = sys.argv[2], sys.argv[3], sys.argv[4]
resumed = json.load(open(sys.argv[5]))["checkpoints"]["resumed_bytes"]
ck = d["checkpoints"]
n = max(ck["saved"], 1)
tokens = d["global_batch"] * d["bptt"]
step_ms = 1e3 * tokens / d["steady_throughput"] if d.get("steady_throughput") else float("nan")
blocked, worst, write = 1e3 * ck["blocked_s"] / n, 1e3 * ck["max_blocked_s"], 1e3 * ck["write_s"] / n
assert ck["sharded"] == (form == "sharded"), (form, ck)
row = [int(time.time()), name, d["world_size"], d["params"], form, ck["saved"], ck["bytes"], round(blocked, 1), round(worst, 1), round(write, 1), round(step_ms, 1), resumed]
output.append(csv, ",".join(map(str, row)) + "\n")
shown = "one file (rank 0)" if form == "whole" else f"sharded ({d['world_size']} files)"
print(f"| {name} | {shown} | {ck['saved']} | {ck['bytes'] / 2**20:.1f} | {blocked:.1f} / {worst:.1f} | {write:.1f} | {step_ms:.0f} | {resumed / 2**20:.1f} |")
PY
}
per_rank=$((GLOBAL / NPROC))
run dp "$bin/exercise1_nlp" --batch-size "$per_rank" --pad-vocab 128
run zero3 "$bin/exercise1_nlp" --batch-size "$per_rank" --zero 3 --pad-vocab 128
run tp "$bin/exercise3" tp --tp "$NPROC" --batch-size "$GLOBAL" --pad-vocab 128
run pp "$bin/exercise3" pipeline --pp "$NPROC" --batch-size "$GLOBAL" --chunks 8 --schedule 1f1b --pad-vocab 128
echo "appended to $csv"
