#!/usr/bin/env bash
# `make bench-nlp`: training throughput (tokens/s) of exercise1_nlp against the PyTorch eager
# reference (bench/exercise1_nlp_reference.py): same model, batch, bptt, data and threads,
# run alternately (Rust, PyTorch, Rust, PyTorch, ...) so that both see the same machine state;
# prints the medians and their ratio and appends them to results/bench-nlp.csv.
#
#   ROUNDS=3 STEPS=20 THREADS=2 DEVICE=cpu MODEL_FLAGS="--emsize 256 --d-hid 256" make bench-nlp
#
# Run through scripts/with-torch (the Makefile does): it provides TORCH_PYTHON and LibTorch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
ROUNDS="${ROUNDS:-2}"
STEPS="${STEPS:-10}"
THREADS="${THREADS:-$(nproc)}"
DEVICE="${DEVICE:-cpu}"
MODEL_FLAGS="${MODEL_FLAGS:-}"
python="${TORCH_PYTHON:?run through scripts/with-torch}"
bin="${BIN:-target/release}"

train=""
for f in data/wikitext-2/wiki.train.tokens data/wikitext-2/wikitext-2/wiki.train.tokens data/wikitext-2/train.txt; do
    [[ -f "$f" ]] && { train="$f"; break; }
done
[[ -n "$train" ]] || { echo "error: no WikiText-2 train split under data/wikitext-2; run make data-wikitext2" >&2; exit 2; }

# The full training split, and short valid/test splits: throughput counts training steps only,
# and evaluating the whole valid split after the timed steps would only cost wall time.
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
mkdir -p "$work/data"
cp "$train" "$work/data/train.txt"
head -n 200 "$train" > "$work/data/valid.txt"
head -n 200 "$train" > "$work/data/test.txt"
[[ -f "$(dirname "$train")/GENERATED.txt" ]] && generated=yes || generated=no

rust_run() {
    "$bin/exercise1_nlp" --data-dir "$work/data" --device "$DEVICE" --max-steps "$STEPS" --epochs 1 \
        --threads "$THREADS" --quiet --results-dir "$work/rust" $MODEL_FLAGS >"$work/rust.log" 2>&1 \
        || { cat "$work/rust.log" >&2; exit 1; }
    "$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["throughput"])' \
        "$work/rust/exercise1_nlp-transformer-${DEVICE%%:*}.json"
}

torch_run() {
    "$python" bench/exercise1_nlp_reference.py --data-dir "$work/data" --device "$DEVICE" \
        --max-steps "$STEPS" --threads "$THREADS" $MODEL_FLAGS >"$work/torch.log" 2>&1 \
        || { cat "$work/torch.log" >&2; exit 1; }
    "$python" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["tokens_per_s"])' "$work/torch.log"
}

rust=(); torch=()
for round in $(seq "$ROUNDS"); do
    rust+=("$(rust_run)"); torch+=("$(torch_run)")
    echo "round $round: rust ${rust[-1]} tok/s, pytorch ${torch[-1]} tok/s"
done

"$python" - "$DEVICE" "$THREADS" "$STEPS" "$generated" "$MODEL_FLAGS" "${rust[*]}" "${torch[*]}" <<'PY'
import csv, os, statistics, sys, time
device, threads, steps, generated, flags, rust, torch_ = sys.argv[1:]
rust = [float(x) for x in rust.split()]; torch_ = [float(x) for x in torch_.split()]
r, t = statistics.median(rust), statistics.median(torch_)
print(f"\nexercise1_nlp training throughput, {device}, {threads} threads, {steps} steps a run, "
      f"{len(rust)} rounds (medians){', GENERATED data' if generated == 'yes' else ''}")
print(f"| implementation | tokens/s |\n|---|---:|\n| Rust (tch) | {r:.1f} |\n| PyTorch eager | {t:.1f} |")
print(f"ratio Rust/PyTorch: {r / t:.3f}")
os.makedirs("results", exist_ok=True)
path = "results/bench-nlp.csv"
new = not os.path.exists(path)
with open(path, "a", newline="") as f:
    w = csv.writer(f)
    if new:
        w.writerow(["finished_at", "device", "threads", "steps", "rounds", "model_flags", "generated_data",
                    "rust_tokens_per_s", "pytorch_tokens_per_s", "ratio"])
    w.writerow([int(time.time()), device, threads, steps, len(rust), flags, generated, f"{r:.2f}", f"{t:.2f}", f"{r / t:.4f}"])
print(f"appended to {path}")
PY
