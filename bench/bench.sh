#!/usr/bin/env bash
# `make bench`: training throughput of our binaries against the PyTorch peers a demanding user
# would pick, side by side, per exercise and model:
#
#   exercise1 cnn | resnet34 | vgg19   target/release/exercise1      vs bench/exercise1_reference.py      images/s
#   exercise1_nlp transformer          target/release/exercise1_nlp  vs bench/exercise1_nlp_reference.py  tokens/s
#
# Same model, batch, precision, recipe, data (read from data/cifar10 and data/wikitext-2 by all),
# intra-op thread count and device. Each entry first runs each side once untimed (WARM=1: fills
# the CUDA kernel cache, cuDNN's choices and torch.compile's caches, and measures how many steps
# make MIN_SECONDS of steady state), then every side runs once per round, ROUNDS times, the
# order rotated by one place each round (A B C, B C A, C A B, ...), so that all see the same
# machine state and none always runs first. Throughput is the steady state on every side: from
# one step's end to the next one's, after the first STEADY_AFTER steps, the device
# synchronised once per step, after the optimizer. results/bench.csv gets one row per entry
# (and Rust mode), with each side's median and spread, the fastest peer and the ratio against
# it (bench/bench_report.py's header lists the columns).
#
# The peers (PEERS; bench/peers.py says how each trains):
#   eager                PyTorch eager, the optimizer's default implementation (always run: the baseline)
#   fused                eager, the optimizer's fused kernel (fused=True)
#   channels-last        eager, model and inputs channels-last (conv nets)
#   channels-last-fused  both (conv nets)
#   compile              torch.compile, default mode, fused optimizer (inductor lays convolutions out itself)
#   reduce-overhead      torch.compile(mode="reduce-overhead"): CUDA graphs, fused optimizer (GPU)
#   cuda-graph           the whole step captured by hand in a CUDA graph, fused capturable optimizer (GPU)
#   lightning            pytorch-lightning's Trainer, as the course's slides (image models)
# Default on a GPU: every peer without CUDA graphs that exists for the entry; with CUDA_GRAPH=1
# also reduce-overhead and cuda-graph. Default on the CPU: eager, fused, channels-last (conv
# nets); compile only when asked (PEERS, or COMPILE=1): inductor takes a minute to warm there.
# CUDA_GRAPH=1 runs our binary twice per round, eager and --cuda-graph, and the CSV has a row
# for each: ours eager against the fastest peer without CUDA graphs, ours --cuda-graph against
# the fastest with them.
#
#   make bench                                     # all four entries, ROUNDS=3, THREADS=nproc, cpu
#   make bench BENCH="cnn" ROUNDS=5 CNN_STEPS=100
#   DEVICE=cuda make bench                         # on a GPU
#   DEVICE=cuda PRECISION=bf16-mixed CUDA_GRAPH=1 make bench
#   DEVICE=cuda PEERS="fused compile" BENCH=nlp make bench
#   TORCH_PYTHON=/path/to/python make bench        # a machine's own PyTorch 2.11.0
#
# Settings (environment):
#   BENCH          entries to run, default "cnn resnet34 vgg19 nlp"
#   ROUNDS         rounds per entry (3)
#   THREADS        intra-op threads on every side (nproc)
#   DEVICE         cpu or cuda (cpu; cuda is the first visible GPU: pick one with CUDA_VISIBLE_DEVICES)
#   PRECISION      32 or bf16-mixed, every side (32)
#   PEERS          the peers, space-separated (default above); eager always runs; a peer that does
#                  not exist on DEVICE is refused, one that does not apply to an entry (channels-last
#                  for the Transformer, lightning for it) is left out of that entry
#   COMPILE        1: add compile to the default peers (0)
#   CUDA_GRAPH     1: also our --cuda-graph run and the CUDA-graph peers (GPU only) (0)
#   CNN_STEPS, RESNET34_STEPS, VGG19_STEPS, NLP_STEPS   least optimizer steps per run (30, 5, 3, 10);
#                  more when the warm-up runs show that they make less than MIN_SECONDS
#   MIN_SECONDS    steady-state seconds each timed run should cover at least (2)
#   STEADY_AFTER   warm-up steps left out of each run's throughput (2)
#   WARM           1: one untimed run per side first (default); 0: none
#   CHANNELS_LAST  1: the Rust image runs with --channels-last (0)
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
# Exit status: 0; 2 for a bad setting (one line); 1 when our binary or the eager peer failed
# (nothing to compare), or when another peer failed: that peer is dropped from the entry (its
# last 20 stderr lines printed), the others go on, the rows are written and name it in
# peers_failed, and the exit status says so.
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
COMPILE="${COMPILE:-0}"
CHANNELS_LAST="${CHANNELS_LAST:-0}"
CUDA_GRAPH="${CUDA_GRAPH:-0}"
WORKERS="${WORKERS:-}"
rust_workers=(); [[ -n "$WORKERS" ]] && rust_workers=(--workers "$WORKERS")
LOADER="${LOADER:-memory}"
PY_WORKERS="${PY_WORKERS:-${WORKERS:-2}}"
NLP_MODEL_FLAGS="${NLP_MODEL_FLAGS:-}"
BENCH_CSV="${BENCH_CSV:-results/bench.csv}"
python="${TORCH_PYTHON:?run through scripts/with-torch (it sets TORCH_PYTHON)}"
bin="${BIN:-target/release}"
report=(bench/bench_report.py)
die() { echo "error: $*" >&2; exit 2; }
fail() { echo "error: $*" >&2; exit 1; }
[[ "$DEVICE" == cpu || "$DEVICE" == cuda ]] || die "DEVICE=$DEVICE: use cpu or cuda (choose the GPU with CUDA_VISIBLE_DEVICES)"
[[ "$PRECISION" == 32 || "$PRECISION" == bf16-mixed ]] || die "PRECISION=$PRECISION: use 32 or bf16-mixed"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: use a whole number of at least 1"
[[ "$CUDA_GRAPH" == 0 || "$CUDA_GRAPH" == 1 ]] || die "CUDA_GRAPH=$CUDA_GRAPH: use 0 or 1"
[[ "$CUDA_GRAPH" == 0 || "$DEVICE" == cuda ]] || die "CUDA_GRAPH=1 records the steps in CUDA graphs: it needs DEVICE=cuda"
for entry in $BENCH; do
    case "$entry" in cnn|resnet34|vgg19|nlp) ;; *) die "unknown bench entry '$entry' (cnn, resnet34, vgg19, nlp)" ;; esac
done

# ---- the peers ---------------------------------------------------------------------------
all_peers="eager fused channels-last channels-last-fused compile reduce-overhead cuda-graph lightning"
if [[ -z "${PEERS+set}" ]]; then
    if [[ "$DEVICE" == cuda ]]; then
        PEERS="eager fused channels-last channels-last-fused compile"
        [[ "$CUDA_GRAPH" == 1 ]] && PEERS+=" reduce-overhead cuda-graph"
    else
        PEERS="eager fused channels-last"
        [[ "$COMPILE" == 1 ]] && PEERS+=" compile"
    fi
fi
[[ " $PEERS " == *" eager "* ]] || PEERS="eager $PEERS"
for peer in $PEERS; do
    [[ " $all_peers " == *" $peer "* ]] || die "PEERS: unknown peer '$peer' (${all_peers// /, })"
    if [[ "$DEVICE" == cpu && ( "$peer" == reduce-overhead || "$peer" == cuda-graph ) ]]; then
        die "PEERS: $peer replays CUDA graphs: there is no such peer on the CPU (DEVICE=cuda)"
    fi
done
# peer_flags PEER: the reference's flags for it (bench/peers.py).
peer_flags() {
    case "$1" in
        eager) ;;
        fused) echo --fused ;;
        channels-last) echo --channels-last ;;
        channels-last-fused) echo --channels-last --fused ;;
        compile) echo --compile default --fused ;;
        reduce-overhead) echo --compile reduce-overhead --fused ;;
        cuda-graph) echo --cuda-graph --fused ;;
    esac
}
# sides_for ENTRY: our runs, then the peers that apply to ENTRY.
sides_for() {
    local sides="rust" peer
    [[ "$CUDA_GRAPH" == 1 ]] && sides+=" rust-graph"
    for peer in $PEERS; do
        if [[ "$1" == nlp && ( "$peer" == channels-last* || "$peer" == lightning ) ]]; then
            echo "exercise1_nlp: the $peer peer is for the image models; left out" >&2
            continue
        fi
        sides+=" $peer"
    done
    echo "$sides"
}

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
failed_peers=""

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
    local records=0
    for f in data_batch_{1..5}.bin; do
        ln -s "$src/$f" "$work/cifar10/$f"
        records=$(( records + $(stat -L -c %s "$src/$f") / 3073 ))
    done
    # Batches of 100 per epoch (both sides' batch): our binary's --epochs must cover --max-steps.
    cifar_batches=$(( (records + 99) / 100 ))
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

# ---- one run of one side; every run appends one JSON line to $runs -------------------------
# side_command ENTRY SIDE STEPS OUT: sets $cmd, the command of SIDE's run of STEPS steps of
# ENTRY (our binary writes its results JSON under OUT).
side_command() {
    local entry="$1" side="$2" steps="$3" out="$4" flags model_flags
    read -r -a flags <<<"$(peer_flags "$side")"
    read -r -a model_flags <<<"$NLP_MODEL_FLAGS"
    local layout=(); [[ "$CHANNELS_LAST" == 1 ]] && layout=(--channels-last)
    case "$entry:$side" in
        # --epochs: enough for --max-steps to end every run (an epoch has at least one step); the
        # reference's stream wraps around instead.
        nlp:rust*) cmd=("$bin/exercise1_nlp" --data-dir "$work/wikitext-2" --max-steps "$steps" --epochs "$steps" "${model_flags[@]}") ;;
        nlp:*) cmd=("$python" bench/exercise1_nlp_reference.py --data-dir "$work/wikitext-2" --max-steps "$steps" "${model_flags[@]}" "${flags[@]}") ;;
        *:rust*) cmd=("$bin/exercise1" --model "$entry" --data-dir "$work/cifar10" --max-steps "$steps"
                      --epochs $(( (steps + cifar_batches - 1) / cifar_batches )) "${rust_workers[@]}" "${layout[@]}") ;;
        *:lightning) cmd=("$python" bench/exercise1_lightning.py --model "$entry" --data-dir "$work/cifar10" --max-steps "$steps") ;;
        *) cmd=("$python" bench/exercise1_reference.py --model "$entry" --data-dir "$work/cifar10" --max-steps "$steps"
                --loader "$LOADER" --workers "$PY_WORKERS" "${flags[@]}") ;;
    esac
    cmd+=(--device "$DEVICE" --threads "$THREADS" --precision "$PRECISION" --steady-after "$STEADY_AFTER")
    case "$side" in
        rust) cmd+=(--quiet --results-dir "$out") ;;
        rust-graph) cmd+=(--quiet --results-dir "$out" --cuda-graph) ;;
    esac
}

# run_side ENTRY SIDE ROUND STEPS: one run, recorded in $runs; sets $figure (its throughput,
# or FAILED). A failed peer is recorded as failed, its stderr's last 20 lines shown, and named
# in $failed_peers; a failed run of ours or of the eager peer ends the bench (exit 1).
run_side() {
    local entry="$1" side="$2" round="$3" steps="$4" others cmd=()
    local log="$work/$entry-$side-$round" code=0
    side_command "$entry" "$side" "$steps" "$log.results"
    others_start
    "${cmd[@]}" >"$log.out" 2>"$log.err" || code=$?
    others_stop
    if [[ "$code" != 0 ]]; then
        echo "$side ($entry, $([[ $round == 0 ]] && echo warm-up || echo "round $round")) failed with exit status $code; the last 20 lines of its stderr:" >&2
        tail -n 20 "$log.err" | sed 's/^/    /' >&2
        [[ "$side" == rust* || "$side" == eager ]] && fail "$side failed on $entry: nothing to compare with"
        "$python" "${report[@]}" record --runs "$runs" --entry "$entry" --side "$side" --round "$round" --others "$others" \
            --failed "$(grep -v '^[[:space:]]*$' "$log.err" | tail -n 1)" >/dev/null
        failed_peers+=" $entry:$side"
        figure=FAILED
        return 0
    fi
    local source=(--peer-stdout "$log.out")
    if [[ "$side" == rust* ]]; then
        local json=("$log.results"/*.json)
        [[ -f "${json[0]}" ]] || { cat "$log.err" >&2; fail "$side wrote no results JSON for $entry"; }
        source=(--rust-json "${json[0]}")
    fi
    "$python" "${report[@]}" record --runs "$runs" --entry "$entry" --side "$side" --round "$round" --others "$others" \
        "${source[@]}" >"$work/figure"
    figure="$(<"$work/figure")"
    if [[ "$others" != 0.0* ]]; then figure+=" (others busy: $others cores)"; fi
}

# steps_for ENTRY LEAST: LEAST, or more where the warm-up runs (round 0) made fewer than
# MIN_SECONDS of steady state at their speed; the slowest side decides.
steps_for() {
    "$python" - "$runs" "$1" "$2" "$MIN_SECONDS" "$STEADY_AFTER" <<'PY'
import json, math, sys
path, entry, least, seconds, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
warm = [r for r in map(json.loads, open(path).read().splitlines()) if r["entry"] == entry and r["round"] == 0 and not r.get("failed")]
per_s = [r["throughput"] / r["examples_per_step"] for r in warm if r.get("examples_per_step")]
print(max(least, after + 2 + (math.ceil(seconds * min(per_s)) if per_s else 0)))
PY
}

# run_round ENTRY ROUND STEPS SIDES...: every side once, the order rotated by ROUND - 1 places
# (the warm-up, round 0, in the given order); a peer that failed earlier in the entry is skipped.
run_round() {
    local entry="$1" round="$2" steps="$3"; shift 3
    local sides=("$@") n=$# i line="" figure
    for ((i = 0; i < n; i++)); do
        local side="${sides[(i + (round > 0 ? round - 1 : 0)) % n]}"
        [[ " $failed_peers " == *" $entry:$side "* ]] && continue
        run_side "$entry" "$side" "$round" "$steps"
        line+="${line:+, }$side $figure"
    done
    echo "$([[ "$entry" == nlp ]] && echo exercise1_nlp || echo "exercise1 $entry") $([[ $round == 0 ]] && echo "warm-up" || echo "round $round/$ROUNDS")" \
        "($steps steps, $([[ "$entry" == nlp ]] && echo tokens/s || echo images/s)): $line"
}

for entry in $BENCH; do
    case "$entry" in
        nlp) nlp_data; steps="$NLP_STEPS" ;;
        *) cifar_data; var="${entry^^}_STEPS"; steps="${!var}" ;;
    esac
    read -r -a sides <<<"$(sides_for "$entry")"
    [[ "$WARM" == 1 ]] && run_round "$entry" 0 "$steps" "${sides[@]}"
    steps="$(steps_for "$entry" "$steps")"
    for round in $(seq "$ROUNDS"); do run_round "$entry" "$round" "$steps" "${sides[@]}"; done
done

"$python" "${report[@]}" table --runs "$runs" --csv "$BENCH_CSV" --device "$DEVICE" --threads "$THREADS" \
    --rounds "$ROUNDS" --workers "${WORKERS:-default}" --nlp-model-flags "$NLP_MODEL_FLAGS" --note "${BENCH_NOTE:-}" \
    --precision "$PRECISION" --steady-after "$STEADY_AFTER" --rust-layout "$([[ "$CHANNELS_LAST" == 1 ]] && echo channels-last || echo nchw)" \
    ${NLP_CSV:+--nlp-csv "$NLP_CSV"}
[[ -z "$failed_peers" ]] || fail "peers failed (left out of their entries; their stderr is above):$(tr ' ' '\n' <<<"$failed_peers" | sort -u | tr '\n' ' ')"
