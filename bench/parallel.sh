#!/usr/bin/env bash
# `make bench-parallel`: the course's "parallelisms for huge models" side by side on CPU ranks.
# One Transformer (d 256, d_hid 1024, 8 heads, 4 layers; the real WikiText-2 valid split as
# training text, 200 lines of each split to evaluate on, the vocabulary padded to a multiple of 128), NPROC=4 ranks, the same global
# batch (GLOBAL=16 streams of 35 tokens), Adam, trained STEPS steps each way:
#   dp       4 data-parallel replicas (exercise1_nlp), gradients all-reduced
#   zero1-3  the same replicas with ZeRO stages 1, 2, 3 (--zero N)
#   tp       every layer cut over 4 ranks (exercise3 tp, Megatron-LM)
#   tp+sp    the same with sequence parallelism (--sequence-parallel; 35-token windows padded to 36)
#   pp       4 pipeline stages, 8 micro-batches, 1F1B (exercise3 pipeline)
#   tp2xdp2  2 replicas of a model cut over 2 ranks; pp2xtp2: 2 stages of 2 shards
#   hsdp2x2  ZeRO-3 within 2 shard groups of 2 replicas, blocks averaged across them
#            (--zero 3 --shard-group 2, HSDP)
# and for each: time per step (steady state, after 2 warm-up steps), what rank 0 hands to the
# collectives per step (bytes of its tensors, by kind, and of them what crosses between HSDP's
# shard groups), rank 0's model state (parameters,
# gradients, optimizer) measured from its tensors and ZeRO's formula for it, and the peak
# memory of training on the rank that held the most (bytes held by tensors at the peak over
# those held before) beside what --estimate-memory predicted for that rank. Rows go to
# results/bench-parallel.csv; a table is printed. Not a test: the ranks share this machine's
# cores, so the times compare the configurations here, not a cluster's.
#
#   make bench-parallel                          NPROC=4 GLOBAL=16 STEPS=12 THREADS=1
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NPROC="${NPROC:-4}"; GLOBAL="${GLOBAL:-16}"; STEPS="${STEPS:-12}"; THREADS="${THREADS:-1}"
bin="${BIN:-target/release}"
csv="results/bench-parallel.csv"
# shellcheck source=bench/transformer.sh
source "$root/bench/transformer.sh"
common=("${transformer_flags[@]}" --max-steps "$STEPS")

header="finished_at,layout,ranks,dp,pp,tp,zero,global_batch,params,step_ms,all_reduce_bytes,reduce_scatter_bytes,all_gather_bytes,send_bytes,between_groups_bytes,model_state_bytes,formula_bytes,formula,peak_rank,peak_training_bytes,estimated_bytes"
if [[ -f "$csv" && "$(head -n 1 "$csv")" != "$header" ]]; then
    mv "$csv" "$csv.$(date +%s).old"; echo "note: $csv had other columns; moved it aside" >&2
fi
PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "$header"  # refuses a link or a FIFO there, before the first run
echo "Transformer d 256, 4 layers, $NPROC ranks, global batch $GLOBAL × 35 tokens, Adam; per step and per rank (rank 0; peak: the rank that held most):"
echo "| layout | step (ms) | all-reduce MiB | reduce-scatter MiB | all-gather MiB | send MiB | between groups MiB | model state MiB | formula | peak MiB (rank) | estimated MiB |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
# run NAME COMMAND...: one configuration (the common flags appended), its row and table line.
run() {
    local name="$1"; shift
    rm -rf "$work/results" "$work/estimate"
    "$@" "${common[@]}" --nproc-per-node "$NPROC" --results-dir "$work/estimate" --estimate-memory > "$work/log" 2>&1 \
        || { echo "error: $name --estimate-memory failed:" >&2; tail -n 20 "$work/log" >&2; exit 1; }
    "$@" "${common[@]}" --nproc-per-node "$NPROC" --results-dir "$work/results" > "$work/log" 2>&1 \
        || { echo "error: $name failed:" >&2; tail -n 20 "$work/log" >&2; exit 1; }
    python3 - "$work/results"/*-cpu.json "$csv" "$name" "$work/estimate"/*.memory-estimate.json <<'PY'
import json, sys, time
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
d = json.load(open(sys.argv[1]))
csv, name = sys.argv[2], sys.argv[3]
estimate = json.load(open(sys.argv[4]))["ranks"]
# The rank that held most in training, and the estimate's row for it (a row per stage, or one).
peak = max(d["peak_memory"], key=lambda p: p["training_peak_bytes"] - p["baseline_bytes"])
held = peak["training_peak_bytes"] - peak["baseline_bytes"]
stage = (peak["rank"] // d["layout"]["tp"]) % d["layout"]["pp"]
estimated = estimate[min(stage, len(estimate) - 1)]["total"]
layout, comm, mem = d["layout"], d["communication_per_step"] or {}, d["model_state_memory"]
tokens = d["global_batch"] * d["bptt"]
step_ms = 1e3 * tokens / d["steady_throughput"] if d.get("steady_throughput") else float("nan")
b = lambda kind: comm.get(kind, {}).get("bytes", 0)
# What crossed between shard groups: everything the replicate group carried.
across = sum(c["bytes"] for c in (d.get("communication_per_step_by_group") or {}).get("dp_replicate", {}).values())
mib = lambda x: x / 2**20
row = [int(time.time()), name, d["world_size"], layout["dp"], layout["pp"], layout["tp"], d["zero"], d["global_batch"], d["params"],
       round(step_ms, 1), b("all_reduce"), b("reduce_scatter"), b("all_gather"), b("send"), across, mem["total_bytes"], int(mem["formula_bytes"]), mem["formula"],
       peak["rank"], held, int(estimated)]
output.append(csv, ",".join(map(str, row)) + "\n")
print(f"| {name} | {step_ms:.0f} | {mib(b('all_reduce')):.2f} | {mib(b('reduce_scatter')):.2f} | {mib(b('all_gather')):.2f} | "
      f"{mib(b('send')):.2f} | {mib(across):.2f} | {mib(mem['total_bytes']):.2f} | {mem['formula']} = {mib(mem['formula_bytes']):.2f} | "
      f"{mib(held):.1f} ({peak['rank']}) | {mib(estimated):.1f} |")
PY
}
per_rank=$((GLOBAL / NPROC))
for zero in 0 1 2 3; do
    name="dp"; ((zero > 0)) && name="zero$zero"
    run "$name" "$bin/exercise1_nlp" --batch-size "$per_rank" --zero "$zero" --pad-vocab 128
done
run tp "$bin/exercise3" tp --tp "$NPROC" --batch-size "$GLOBAL" --pad-vocab 128
run tp+sp "$bin/exercise3" tp --tp "$NPROC" --sequence-parallel --batch-size "$GLOBAL" --pad-vocab 128
run pp "$bin/exercise3" pipeline --pp "$NPROC" --batch-size "$GLOBAL" --chunks 8 --schedule 1f1b --pad-vocab 128
if ((NPROC == 4)); then
    run tp2xdp2 "$bin/exercise3" tp --tp 2 --dp 2 --batch-size $((GLOBAL / 2)) --pad-vocab 128
    run pp2xtp2 "$bin/exercise3" pipeline --pp 2 --tp 2 --batch-size "$GLOBAL" --chunks 8 --schedule 1f1b --pad-vocab 128
    run hsdp2x2 "$bin/exercise1_nlp" --batch-size "$per_rank" --zero 3 --shard-group 2 --pad-vocab 128
fi
echo "appended to $csv"
