#!/usr/bin/env bash
# `make bench-allreduce`: all-reduce time and bus bandwidth from 4 KB to 256 MB on NPROC ranks,
# then exercise2's training throughput on 1 rank and on NPROC ranks, and the scaling
# efficiency (throughput_N / (N × throughput_1)), on DEVICE (cpu by default).
#
#   NPROC=2 DEVICE=cpu STEPS=30 MODEL=cnn make bench-allreduce
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NPROC="${NPROC:-2}"; DEVICE="${DEVICE:-cpu}"; STEPS="${STEPS:-30}"; MODEL="${MODEL:-cnn}"; BATCH="${BATCH:-100}"
bin="${BIN:-target/release}"

"$bin/bench_allreduce" --nproc-per-node "$NPROC" --device "$DEVICE"

work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
train() {
    "$bin/exercise2" --model "$MODEL" --num-classes 10 --device "$DEVICE" --max-steps "$STEPS" --epochs 1 \
        --batch-size "$BATCH" --quiet --results-dir "$work" "$@" > "$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
    python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); e = d.get("scaling_efficiency"); print(format(d["throughput"], ".1f"), format(e, ".3f") if e else "-")' \
        "$work/exercise2-$MODEL-$DEVICE.json"
}
read -r one _ < <(train)
read -r many eff < <(train --nproc-per-node "$NPROC")
echo
echo "exercise2 ($MODEL, batch $BATCH per rank, $STEPS steps) on $DEVICE"
echo "| ranks | images/s |"
echo "|---:|---:|"
echo "| 1 | $one |"
echo "| $NPROC | $many |"
echo "scaling efficiency: $eff (1.0 = linear)"
