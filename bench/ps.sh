#!/usr/bin/env bash
# `make bench-ps`: all-reduce data parallelism vs a synchronous and an asynchronous parameter
# server on CPU ranks, one worker a straggler: exercise2's model (CNN by default) on the real
# MNIST sample (4,000 training / 1,000 test digits, ../shared/data), WORKERS workers × BATCH
# images for EPOCHS epochs (the same training samples for every strategy), worker 1 sleeping
# STRAGGLE seconds in every step (--straggler 1:STRAGGLE), the servers SERVERS extra ranks:
#   all-reduce   WORKERS replicas averaging their gradients (exercise2's Horovod style)
#   ps-sync      --strategy parameter-server --sync: the same model, the servers wait for all
#   ps-async     --strategy parameter-server --async: nobody waits (Downpour)
#   ps-bounded   --async --max-staleness K: the fast worker waits when K versions ahead
# Throughput (training images/s) and test accuracy after the same samples go to
# results/bench-ps.csv, a table, and the chart results/bench-ps.svg (`report ps`): asynchrony
# buys the first and can cost the second.
#
#   make bench-ps                 WORKERS=2 SERVERS=1 BATCH=50 EPOCHS=2 LR=0.05 STRAGGLE=0.05 K=2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
WORKERS="${WORKERS:-2}"; SERVERS="${SERVERS:-1}"; BATCH="${BATCH:-50}"; EPOCHS="${EPOCHS:-2}"; LR="${LR:-0.05}"
STRAGGLE="${STRAGGLE:-0.05}"; K="${K:-2}"; MODEL="${MODEL:-cnn}"; THREADS="${THREADS:-1}"
DATA="${DATA:-$root/../shared/data/mnist-5k}"
bin="${BIN:-target/release}"
csv="results/bench-ps.csv"
[[ -d "$DATA" ]] || { echo "error: no MNIST sample at $DATA (set DATA=...)" >&2; exit 2; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT

PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "finished_at,model,strategy,workers,servers,per_worker_batch,epochs,straggler_s,steps,train_time_s,throughput,test_acc,test_loss,mean_staleness,max_staleness"  # refuses a link or a FIFO there, before the first run
echo "exercise2 --model $MODEL on MNIST ($DATA): $WORKERS workers × batch $BATCH, $EPOCHS epochs, SGD lr $LR momentum 0.9; worker 1 sleeps ${STRAGGLE}s per step; $SERVERS server(s)"
echo "| strategy | ranks | optimizer steps | train time (s) | throughput (img/s) | test accuracy | test loss | staleness mean / max |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for strategy in all-reduce ps-sync ps-async ps-bounded; do
    case "$strategy" in
        all-reduce) ranks=$WORKERS; flags=() ;;
        ps-sync) ranks=$((WORKERS + SERVERS)); flags=(--strategy parameter-server --servers "$SERVERS" --sync) ;;
        ps-async) ranks=$((WORKERS + SERVERS)); flags=(--strategy parameter-server --servers "$SERVERS" --async) ;;
        ps-bounded) ranks=$((WORKERS + SERVERS)); flags=(--strategy parameter-server --servers "$SERVERS" --async --max-staleness "$K") ;;
    esac
    rm -rf "$work/results"
    "$bin/exercise2" --model "$MODEL" --dataset mnist --data-dir "$DATA" --num-classes 10 --device cpu --threads "$THREADS" \
        --nproc-per-node "$ranks" --max-ranks-per-core 8 --batch-size "$BATCH" --epochs "$EPOCHS" --optimizer sgd --lr "$LR" --momentum 0.9 \
        --straggler "1:$STRAGGLE" "${flags[@]}" --quiet --results-dir "$work/results" > "$work/log" 2>&1 \
        || { cat "$work/log" >&2; exit 1; }
    python3 - "$work/results/exercise2-$MODEL-cpu.json" "$csv" "$strategy" "$WORKERS" "$SERVERS" "$STRAGGLE" "$ranks" <<'PY'
import json, sys, time
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
d = json.load(open(sys.argv[1]))
strategy, workers, servers, straggle, ranks = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
ps = d.get("parameter_server") or {}
servers = servers if ps else 0
mean, top = ps.get("mean_staleness", 0.0), ps.get("max_staleness_seen", 0)
throughput = d["throughput"]
row = [int(time.time()), d["model"], strategy, workers, servers, d["per_rank_batch"], d["epochs"], straggle, d["steps"],
       round(d["train_time_s"], 2), round(throughput, 1), round(d["test_acc"], 4), round(d["test_loss"], 4), round(mean, 2), top]
output.append(sys.argv[2], ",".join(map(str, row)) + "\n")
print(f"| {strategy} | {ranks} | {d['steps']} | {d['train_time_s']:.1f} | {throughput:.0f} | {d['test_acc']:.4f} | {d['test_loss']:.4f} | {mean:.2f} / {top} |")
PY
done
echo "appended to $csv"
"$bin/report" ps --results-dir results
