#!/usr/bin/env bash
# `make bench-largebatch`: the course's large-batch question on CPU ranks. exercise2's model
# (CNN by default) on the real MNIST sample (4,000 training / 1,000 test digits, ../shared/data),
# NPROC ranks × BATCH images × --accumulate K, so effective batches of 100, 800 and 3,200,
# each for the same number of training samples (EPOCHS epochs), trained three ways:
#   plain   SGD with momentum at the small batch's learning rate
#   scaled  linear scaling of the rate by the effective batch's growth, warm-up over WARMUP epochs
#           from the small batch's rate (Goyal et al. 2017: --scale-lr --warmup-epochs)
#   lars    the same scaled rate and warm-up with LARS's layer-wise trust ratios (--optimizer lars)
# and the final test accuracy of each goes to results/bench-largebatch.csv and a table.
#
#   make bench-largebatch                    NPROC=2 BATCH=50 EPOCHS=8 LR=0.05 MODEL=cnn
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NPROC="${NPROC:-2}"; BATCH="${BATCH:-50}"; EPOCHS="${EPOCHS:-8}"; LR="${LR:-0.05}"; WARMUP="${WARMUP:-2}"; MODEL="${MODEL:-cnn}"
DATA="${DATA:-$root/../shared/data/mnist-5k}"
bin="${BIN:-target/release}"
csv="results/bench-largebatch.csv"
[[ -d "$DATA" ]] || { echo "error: no MNIST sample at $DATA (set DATA=...)" >&2; exit 2; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT

PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "finished_at,model,ranks,per_rank_batch,accumulate,effective_batch,recipe,optimizer,lr,epochs,steps,test_acc,test_loss,train_time_s"  # refuses a link or a FIFO there, before the first run
echo "exercise2 --model $MODEL on MNIST ($DATA), $NPROC ranks × batch $BATCH, $EPOCHS epochs; base lr $LR (SGD momentum 0.9)"
echo "| effective batch | recipe | optimizer steps | peak lr | test accuracy | test loss |"
echo "|---:|---|---:|---:|---:|---:|"
for accumulate in 1 8 32; do
    effective=$((NPROC * BATCH * accumulate))
    for recipe in plain scaled lars; do
        case "$recipe" in
            plain) flags=(--optimizer sgd) ;;
            scaled) flags=(--optimizer sgd --scale-lr --warmup-epochs "$WARMUP") ;;
            lars) flags=(--optimizer lars --scale-lr --warmup-epochs "$WARMUP") ;;
        esac
        rm -rf "$work/results"
        "$bin/exercise2" --model "$MODEL" --dataset mnist --data-dir "$DATA" --num-classes 10 --device cpu --threads 1 \
            --nproc-per-node "$NPROC" --batch-size "$BATCH" --accumulate "$accumulate" --epochs "$EPOCHS" --lr "$LR" \
            --momentum 0.9 "${flags[@]}" --quiet --results-dir "$work/results" > "$work/log" 2>&1 \
            || { cat "$work/log" >&2; exit 1; }
        python3 - "$work/results/exercise2-$MODEL-cpu.json" "$csv" "$recipe" "$effective" <<'PY'
import json, sys, time
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
d = json.load(open(sys.argv[1]))
recipe, effective = sys.argv[3], int(sys.argv[4])
row = [int(time.time()), d["model"], d["world_size"], d["per_rank_batch"], d["accumulate"], effective, recipe, d["optimizer"],
       d["lr"], d["epochs"], d["steps"], round(d["test_acc"], 4), round(d["test_loss"], 4), round(d["train_time_s"], 1)]
output.append(sys.argv[2], ",".join(map(str, row)) + "\n")
print(f"| {effective} | {recipe} | {d['steps']} | {d['lr']:g} | {d['test_acc']:.4f} | {d['test_loss']:.4f} |")
PY
    done
done
echo "appended to $csv"
