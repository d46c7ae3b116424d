#!/usr/bin/env bash
# `make bench`: training throughput of our binaries against their PyTorch eager references,
# side by side, per exercise and model:
#
#   exercise1 cnn | resnet34 | vgg19   target/release/exercise1      vs bench/exercise1_reference.py   images/s
#   exercise1_nlp transformer          target/release/exercise1_nlp  vs bench/exercise1_nlp_reference.py  tokens/s
#
# Same model, batch, precision, data (read from data/cifar10 and data/wikitext-2 by both),
# intra-op thread count and device. Each entry first runs each side once untimed (WARM=1: fills
# the CUDA kernel cache and cuDNN's choices, and measures how many steps make MIN_SECONDS of
# steady state), then the pairs run alternately, Rust then PyTorch, ROUNDS times (A B A B ...),
# so that both see the same machine state. Throughput is the steady state on both sides: from
# one step's end to the next one's, after the first STEADY_AFTER steps (the binaries'
# --steady-after; the references' --steady-after / --warmup). Image entries add the PyTorch
# peers a user would pick (PEERS: channels-last, and torch.compile with COMPILE=1). The table
# shows medians and the ratios Rust/PyTorch; results/bench.csv gets one row per entry, with the
# GPU's name on a GPU.
#
#   make bench                                     # all four entries, ROUNDS=3, THREADS=nproc, cpu
#   make bench BENCH="cnn" ROUNDS=5 CNN_STEPS=100
#   DEVICE=cuda make bench                         # on a GPU (both sides synchronise before timing)
#   DEVICE=cuda PRECISION=bf16-mixed COMPILE=1 make bench
#   TORCH_PYTHON=/path/to/python make bench        # a machine's own PyTorch 2.11.0
#
# Settings (environment):
#   BENCH          entries to run, default "cnn resnet34 vgg19 nlp"
#   ROUNDS         A/B rounds per entry (3)
#   THREADS        intra-op threads on both sides (nproc)
#   DEVICE         cpu or cuda (cpu; cuda is the first visible GPU: pick one with CUDA_VISIBLE_DEVICES)
#   PRECISION      32 or bf16-mixed, both sides (32)
#   CNN_STEPS, RESNET34_STEPS, VGG19_STEPS, NLP_STEPS   least optimizer steps per run (30, 5, 3, 10);
#                  more when the warm-up run shows that they make less than MIN_SECONDS
#   MIN_SECONDS    steady-state seconds each timed run should cover at least (2)
#   STEADY_AFTER   warm-up steps left out of each run's throughput (2)
#   WARM           1: one untimed run per side first (default); 0: none
#   PEERS          PyTorch peers for image entries besides eager: "channels-last" (default) or ""
#   COMPILE        1: also torch.compile as a peer for image entries (0)
#   CHANNELS_LAST  1: the Rust image runs with --channels-last (0)
#   CUDA_GRAPH     1: the Rust runs record their step in a CUDA graph (--cuda-graph; GPU only) (0)
#   WORKERS        Rust loader threads, exercise1's --workers (its default: 0 on the CPU, 2 on a GPU)
#   LOADER         the reference's data path: memory (default) or dataloader (see the script)
#   PY_WORKERS     DataLoader worker processes for LOADER=dataloader (WORKERS)
#   NLP_MODEL_FLAGS  model flags for both exercise1_nlp sides, e.g. "--emsize 256 --d-hid 256"
#   BENCH_CSV      where the rows go (results/bench.csv)
#   BENCH_NOTE     free text for the rows' note column
#   BIN            where the Rust binaries are (target/release)
#   CIFAR_DIR      CIFAR-10's binary files (data/cifar10)
#   WIKITEXT_DIR   WikiText-2's files (data/wikitext-2)
#
# Run through scripts/with-torch (the Makefile does): it provides TORCH_PYTHON and LibTorch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
BENCH="${BENCH:-cnn resnet34 vgg19 nlp}"
ROUNDS="${ROUNDS:-3}"
THREADS="${THREADS:-$(nproc)}"
DEVICE="${DEVICE:-cpu}"
CNN_STEPS="${CNN_STEPS:-30}"
RESNET34_STEPS="${RESNET34_STEPS:-5}"
VGG19_STEPS="${VGG19_STEPS:-3}"
NLP_STEPS="${NLP_STEPS:-10}"
PRECISION="${PRECISION:-32}"
MIN_SECONDS="${MIN_SECONDS:-2}"
STEADY_AFTER="${STEADY_AFTER:-2}"
WARM="${WARM:-1}"
PEERS="${PEERS-channels-last}"
COMPILE="${COMPILE:-0}"
CHANNELS_LAST="${CHANNELS_LAST:-0}"
CUDA_GRAPH="${CUDA_GRAPH:-0}"
rust_graph=(); [[ "$CUDA_GRAPH" == 1 ]] && rust_graph=(--cuda-graph)
WORKERS="${WORKERS:-}"
rust_workers=(); [[ -n "$WORKERS" ]] && rust_workers=(--workers "$WORKERS")
LOADER="${LOADER:-memory}"
PY_WORKERS="${PY_WORKERS:-${WORKERS:-2}}"
NLP_MODEL_FLAGS="${NLP_MODEL_FLAGS:-}"
BENCH_CSV="${BENCH_CSV:-results/bench.csv}"
python="${TORCH_PYTHON:?run through scripts/with-torch (it sets TORCH_PYTHON)}"
bin="${BIN:-target/release}"
die() { echo "error: $*" >&2; exit 2; }
[[ "$DEVICE" == cpu || "$DEVICE" == cuda ]] || die "DEVICE=$DEVICE: use cpu or cuda (choose the GPU with CUDA_VISIBLE_DEVICES)"
[[ "$PRECISION" == 32 || "$PRECISION" == bf16-mixed ]] || die "PRECISION=$PRECISION: use 32 or bf16-mixed"

# How busy other processes kept the CPUs during a run: all CPU time the machine spent (from
# /proc/stat) minus this script's children's, over the wall time, in cores. Other load makes
# the comparison unreliable (see docs/speed.md).
hz="$(getconf CLK_TCK 2>/dev/null || echo 100)"
machine_cpu_s() { awk -v hz="$hz" '/^cpu /{printf "%.3f", ($2+$3+$4+$7+$8+$9)/hz; exit}' /proc/stat 2>/dev/null || echo 0; }
# `times` (this shell's children's CPU time) only means something in this shell, not in a $(…).
children_cpu_s() { awk 'NR==2{n=split($0,f," "); s=0; for(i=1;i<=n;i++){split(f[i],p,"m"); s+=p[1]*60+p[2]}; printf "%.3f", s}' "$1"; }
others_start() { t0_wall="$(date +%s.%N)"; t0_machine="$(machine_cpu_s)"; times >"$work/times0"; }
others_stop() { # sets $others
    local w1 m1
    w1="$(date +%s.%N)"; m1="$(machine_cpu_s)"; times >"$work/times1"
    others="$(awk -v w0="$t0_wall" -v w1="$w1" -v m0="$t0_machine" -v m1="$m1" \
        -v c0="$(children_cpu_s "$work/times0")" -v c1="$(children_cpu_s "$work/times1")" \
        'BEGIN { o = ((m1 - m0) - (c1 - c0)) / (w1 - w0); printf "%.2f", (o < 0 ? 0 : o) }')"
}

work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
runs="$work/runs.jsonl"; : >"$runs"

# ---- data: the real files, with short evaluation splits ----------------------------------
# Throughput counts training steps only; evaluating a whole test split after a few timed
# steps would only cost wall time (VGG19 on a CPU: minutes), so the Rust side evaluates on
# the first 100 test images. The reference does not evaluate.
cifar_data() {
    [[ -d "$work/cifar10" ]] && return
    local src="${CIFAR_DIR:-data/cifar10}"
    [[ -f "$src/test_batch.bin" || ! -d "$src/cifar-10-batches-bin" ]] || src="$src/cifar-10-batches-bin"
    for f in data_batch_{1..5}.bin test_batch.bin; do
        [[ -f "$src/$f" ]] || die "no $src/$f: run make data-cifar10"
    done
    mkdir -p "$work/cifar10"
    src="$(cd "$src" && pwd)"
    for f in data_batch_{1..5}.bin; do ln -s "$src/$f" "$work/cifar10/$f"; done
    head -c $((100 * 3073)) "$src/test_batch.bin" >"$work/cifar10/test_batch.bin"
    for marker in "${CIFAR_DIR:-data/cifar10}/GENERATED.txt" "$src/GENERATED.txt"; do
        [[ -f "$marker" ]] && cp "$marker" "$work/cifar10/GENERATED.txt"
    done
    return 0
}

nlp_data() {
    [[ -d "$work/wikitext-2" ]] && return
    local train="" src="${WIKITEXT_DIR:-data/wikitext-2}"
    for f in "$src/wiki.train.tokens" "$src/wikitext-2/wiki.train.tokens" "$src/train.txt"; do
        [[ -f "$f" ]] && { train="$f"; break; }
    done
    [[ -n "$train" ]] || die "no WikiText-2 train split under $src: run make data-wikitext2"
    mkdir -p "$work/wikitext-2"
    ln -s "$(cd "$(dirname "$train")" && pwd)/$(basename "$train")" "$work/wikitext-2/train.txt"
    head -n 200 "$train" >"$work/wikitext-2/valid.txt"
    head -n 200 "$train" >"$work/wikitext-2/test.txt"
    [[ -f "$(dirname "$train")/GENERATED.txt" ]] && cp "$(dirname "$train")/GENERATED.txt" "$work/wikitext-2/"
    return 0
}

# ---- one run each; every run appends one JSON line to $runs -------------------------------
# run_rust ENTRY ROUND BINARY ARGS...: the binary's results JSON, tagged (round 0: the warm-up).
run_rust() {
    local entry="$1" round="$2" binary="$3"; shift 3
    local out="$work/rust-$entry-$round" others
    others_start
    "$bin/$binary" "$@" --device "$DEVICE" --threads "$THREADS" --precision "$PRECISION" \
        --steady-after "$STEADY_AFTER" --quiet --results-dir "$out" "${rust_graph[@]}" \
        >"$out.log" 2>&1 || { cat "$out.log" >&2; die "$binary failed"; }
    others_stop
    local json=("$out"/*.json)
    [[ -f "${json[0]}" ]] || { cat "$out.log" >&2; die "$binary wrote no results JSON"; }
    "$python" - "$entry" "$round" "${json[0]}" "$others" >>"$runs" <<'PY'
import json, sys
entry, round_, path, others = sys.argv[1:]
r = json.load(open(path))
print(json.dumps({"entry": entry, "impl": "rust", "round": int(round_), "others": float(others),
                  "throughput": r.get("steady_throughput") or r["throughput"], "steady": r.get("steady_throughput") is not None,
                  "examples_per_step": r["throughput"] * r["train_time_s"] / max(r["steps"], 1), "device_name": r.get("device"),
                  "steps": r["steps"], "params": r["params"], "train_time_s": r["train_time_s"],
                  "data_wait_s": r["data_wait_s"], "forward_backward_s": r["forward_backward_s"],
                  "optimizer_s": r["optimizer_s"], "generated": r.get("data_generated"),
                  "torch_version": r.get("torch_version")}))
PY
}

# run_torch ENTRY IMPL ROUND SCRIPT ARGS...: the reference's JSON line, tagged with IMPL
# (pytorch, pytorch-channels-last, pytorch-compile).
run_torch() {
    local entry="$1" impl="$2" round="$3" script="$4"; shift 4
    local out="$work/$impl-$entry-$round" others
    others_start
    "$python" "$script" "$@" --device "$DEVICE" --threads "$THREADS" --precision "$PRECISION" >"$out.log" 2>&1 \
        || { cat "$out.log" >&2; die "$script $* failed"; }
    others_stop
    "$python" - "$entry" "$impl" "$round" "$out.log" "$others" >>"$runs" <<'PY'
import json, sys
entry, impl, round_, path, others = sys.argv[1:]
r = json.loads(open(path).read().splitlines()[-1])
print(json.dumps({"entry": entry, "impl": impl, "round": int(round_), "others": float(others),
                  "throughput": r.get("steady_throughput") or r.get("images_per_s", r.get("tokens_per_s")),
                  "steady": r.get("steady_throughput") is not None, "gpu": r.get("gpu"), "steps": r["steps"],
                  "examples_per_step": r["images"] / r["steps"] if "images" in r
                      else r["tokens_per_s"] * r["train_time_s"] / max(r.get("timed_steps") or r["steps"], 1),
                  "params": r["params"], "train_time_s": r.get("train_time_s"),
                  "data_wait_s": r.get("data_wait_s"), "forward_backward_s": r.get("forward_backward_s"),
                  "optimizer_s": r.get("optimizer_s"), "generated": r.get("generated_data"),
                  "torch_version": r.get("torch_version"), "loader": r.get("loader"),
                  "layouts": r.get("layouts")}))
PY
}

# ", other processes: R + P cores" for the last pair, when they used any.
last_others() { "$python" -c 'import json,sys; l=[json.loads(x) for x in open(sys.argv[1]).read().splitlines()[-2:]]; o=[x["others"] for x in l]; print(", other processes busy on %.2f / %.2f cores" % tuple(o) if max(o) >= 0.1 else "")' "$runs"; }
last_throughput() { "$python" -c 'import json,sys; print("%.1f" % json.loads(open(sys.argv[1]).read().splitlines()[-1])["throughput"])' "$runs"; }
# steps_for ENTRY LEAST: LEAST, or more where the warm-up runs (round 0) made fewer than
# MIN_SECONDS of steady state at their speed; the slower side decides.
steps_for() {
    "$python" - "$runs" "$1" "$2" "$MIN_SECONDS" "$STEADY_AFTER" <<'PY'
import json, math, sys
path, entry, least, seconds, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
warm = [r for r in map(json.loads, open(path).read().splitlines()) if r["entry"] == entry and r["round"] == 0]
per_s = [r["throughput"] / (r["examples_per_step"]) for r in warm if r.get("examples_per_step")]
print(max(least, after + 2 + (math.ceil(seconds * min(per_s)) if per_s else 0)))
PY
}

# run_pair ENTRY ROUND STEPS: one run of each side (and the peers), Rust first.
run_image_round() {
    local entry="$1" round="$2" steps="$3"
    local per_epoch=$(( (50000 + 99) / 100 )) epochs
    epochs=$(( (steps + per_epoch - 1) / per_epoch ))
    local layout=(); [[ "$CHANNELS_LAST" == 1 ]] && layout=(--channels-last)
    run_rust "$entry" "$round" exercise1 --model "$entry" --data-dir "$work/cifar10" \
        --max-steps "$steps" --epochs "$epochs" "${rust_workers[@]}" "${layout[@]}"
    local r; r="$(last_throughput)"
    local ref=(bench/exercise1_reference.py --model "$entry" --data-dir "$work/cifar10" --max-steps "$steps"
               --steady-after "$STEADY_AFTER" --loader "$LOADER" --workers "$PY_WORKERS")
    run_torch "$entry" pytorch "$round" "${ref[@]}"
    local line="rust $r images/s, pytorch $(last_throughput)$(last_others)"
    if [[ "$PEERS" == *channels-last* ]]; then
        run_torch "$entry" pytorch-channels-last "$round" "${ref[@]}" --channels-last
        line+=", channels-last $(last_throughput)"
    fi
    if [[ "$COMPILE" == 1 ]]; then
        run_torch "$entry" pytorch-compile "$round" "${ref[@]}" --compile
        line+=", torch.compile $(last_throughput)"
    fi
    echo "exercise1 $entry $([[ $round == 0 ]] && echo "warm-up" || echo "round $round/$ROUNDS") ($steps steps): $line"
}

run_nlp_round() {
    local round="$1" steps="$2"
    # shellcheck disable=SC2086 # MODEL_FLAGS are words
    run_rust nlp "$round" exercise1_nlp --data-dir "$work/wikitext-2" --max-steps "$steps" --epochs 1 $NLP_MODEL_FLAGS
    local r; r="$(last_throughput)"
    # shellcheck disable=SC2086
    run_torch nlp pytorch "$round" bench/exercise1_nlp_reference.py --data-dir "$work/wikitext-2" \
        --max-steps "$steps" --warmup "$STEADY_AFTER" $NLP_MODEL_FLAGS
    echo "exercise1_nlp $([[ $round == 0 ]] && echo "warm-up" || echo "round $round/$ROUNDS") ($steps steps): rust $r tokens/s, pytorch $(last_throughput) tokens/s$(last_others)"
}

for entry in $BENCH; do
    case "$entry" in
        cnn|resnet34|vgg19)
            cifar_data
            var="$(tr a-z A-Z <<<"$entry")_STEPS"; steps="${!var}"
            [[ "$WARM" == 1 ]] && run_image_round "$entry" 0 "$steps"
            steps="$(steps_for "$entry" "$steps")"
            for round in $(seq "$ROUNDS"); do run_image_round "$entry" "$round" "$steps"; done
            ;;
        nlp)
            nlp_data
            [[ "$WARM" == 1 ]] && run_nlp_round 0 "$NLP_STEPS"
            steps="$(steps_for nlp "$NLP_STEPS")"
            for round in $(seq "$ROUNDS"); do run_nlp_round "$round" "$steps"; done
            ;;
        *) die "unknown bench entry '$entry' (cnn, resnet34, vgg19, nlp)" ;;
    esac
done

"$python" bench/bench_report.py --runs "$runs" --csv "$BENCH_CSV" --device "$DEVICE" --threads "$THREADS" \
    --rounds "$ROUNDS" --loader "$LOADER" --workers "${WORKERS:-default}" --nlp-model-flags "$NLP_MODEL_FLAGS" --note "${BENCH_NOTE:-}${rust_graph[*]:+ rust --cuda-graph}" \
    --precision "$PRECISION" --steady-after "$STEADY_AFTER" --rust-layout "$([[ "$CHANNELS_LAST" == 1 ]] && echo channels-last || echo nchw)" \
    ${NLP_CSV:+--nlp-csv "$NLP_CSV"}
