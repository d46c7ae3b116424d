#!/usr/bin/env bash
# `make scaling`: the scaling study every course shows (JSC's ResNet50 table, Namal's epoch time
# against GPUs, IDRIS's FP32-vs-AMP curves), on local ranks. EXERCISE runs at each of RANKS
# ranks (--nproc-per-node N; one plain process at 1), trained EPOCHS whole epochs, in one or
# both modes:
#   strong  the global batch held (GLOBAL images; each rank trains GLOBAL / N of them per step)
#   weak    the batch per rank held (PER_RANK images; the global batch grows with the ranks)
# each in every precision of PRECISION. Every run's results JSON goes to
# RESULTS/scaling/<mode>/ranks-<N>[-<precision>]/, then `report scaling` turns them into
# RESULTS/scaling.csv (time per epoch and per step, throughput, speed-up, efficiency, all-reduce
# share) and RESULTS/scaling.svg, and prints the table. A mode's folder is emptied before its
# sweep: one study, one configuration.
#
#   make scaling                                   both modes, RANKS="1 2 4", the CNN on the CPU
#   make scaling MODE=weak  (or WEAK=1)            bench/scaling.sh --weak
#   make scaling PRECISION="32 bf16-mixed"         IDRIS's FP32 vs mixed precision
#   make scaling DEVICE=cuda RANKS="1 2 4 8"       the GPUs of one node (MODEL: the exercise's own)
#
# Settings: EXERCISE (exercise2; "exercise3 ddp" works too), MODE (both|strong|weak), RANKS,
# GLOBAL (128), PER_RANK (32), EPOCHS (2), MODEL (cnn on the CPU), DEVICE (cpu), PRECISION (32),
# THREADS (LibTorch threads per rank; 1 on the CPU: see below; 0 = the node's cores shared out),
# DATA (a CIFAR-10 folder; default: TRAIN=4096 generated training images), RESULTS (results),
# ARGS (more flags for every run, e.g. "--workers 0"; not one this script sets: --model,
# --device, --precision, --threads, --data-dir, --epochs, --batch-size, --results-dir, --quiet,
# --nproc-per-node). On the CPU a rank is one core (THREADS=1), as on a GPU node it is one GPU:
# the speed-up then counts what added cores give, and RANKS beyond the cores show
# oversubscription; with the cores shared out instead, the 1-rank baseline runs 2 threads whose
# every parallel region waits for the slower of them (measured 4-5x slower than 1 thread while
# other jobs loaded the 2 cores). The speeds compared are the steady state's (the first 2
# steps of each epoch left out); on a shared machine, run it when nothing else does.
# Across nodes under Slurm: sbatch/scaling.sbatch (one job per node count).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
MODE="${MODE:-both}"
[[ "${WEAK:-0}" == 1 ]] && MODE=weak
[[ "${STRONG:-0}" == 1 ]] && MODE=strong
for arg in "$@"; do
    case "$arg" in
        --strong) MODE=strong ;;
        --weak) MODE=weak ;;
        --both) MODE=both ;;
        *) echo "usage: bench/scaling.sh [--strong|--weak|--both] (settings in the environment: see the script's header)" >&2; exit 2 ;;
    esac
done
EXERCISE="${EXERCISE:-exercise2}"; RANKS="${RANKS:-1 2 4}"; GLOBAL="${GLOBAL:-128}"; PER_RANK="${PER_RANK:-32}"
EPOCHS="${EPOCHS:-2}"; DEVICE="${DEVICE:-cpu}"; PRECISION="${PRECISION:-32}"; TRAIN="${TRAIN:-4096}"
RESULTS="${RESULTS:-results}"; ARGS="${ARGS:-}"
[[ "$DEVICE" == cpu ]] && MODEL="${MODEL-cnn}" || MODEL="${MODEL-}"
[[ "$DEVICE" == cpu ]] && THREADS="${THREADS:-1}" || THREADS="${THREADS:-0}"
bin="${BIN:-target/release}"
case "$MODE" in strong) modes=(strong) ;; weak) modes=(weak) ;; both) modes=(strong weak) ;;
    *) echo "error: MODE=$MODE: strong, weak or both" >&2; exit 2 ;; esac
read -ra exe <<<"$EXERCISE"
[[ -x "$bin/${exe[0]}" ]] || { echo "error: $bin/${exe[0]} is missing: run 'make build'" >&2; exit 2; }
for n in $RANKS; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: RANKS=\"$RANKS\": whole numbers of ranks" >&2; exit 2; }
    ((GLOBAL % n == 0)) || { echo "error: GLOBAL=$GLOBAL images do not divide over $n ranks (strong scaling holds the global batch)" >&2; exit 2; }
done

work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
if [[ -z "${DATA:-}" ]]; then
    # Throughput does not depend on what the images show: a generated set of TRAIN images keeps
    # whole epochs short (and needs no download).
    DATA="$work/cifar10"
    "$bin/prepare_data" generate --dataset cifar10 --train "$TRAIN" --test 256 --out "$DATA" >"$work/log" 2>&1 \
        || { cat "$work/log" >&2; exit 1; }
fi
model=(); [[ -n "$MODEL" ]] && model=(--model "$MODEL")

echo "$EXERCISE ${model[*]} on $DEVICE ($THREADS threads per rank; 0: cores / ranks), $EPOCHS epochs of $DATA; ranks: $RANKS; modes: ${modes[*]}; precision: $PRECISION"
for mode in "${modes[@]}"; do
    rm -rf "$RESULTS/scaling/$mode"
    for precision in $PRECISION; do
        for n in $RANKS; do
            batch=$([[ $mode == strong ]] && echo $((GLOBAL / n)) || echo "$PER_RANK")
            dir="$RESULTS/scaling/$mode/ranks-$n$([[ $precision == 32 ]] || echo "-$precision")"
            launch=(); ((n > 1)) && launch=(--nproc-per-node "$n")
            printf '  %-6s %-10s %2d ranks × batch %-4d ... ' "$mode" "$precision" "$n" "$batch"
            # shellcheck disable=SC2086 # ARGS are flags, split on purpose
            "$bin/${exe[0]}" "${exe[@]:1}" "${model[@]}" --device "$DEVICE" --threads "$THREADS" --precision "$precision" \
                --data-dir "$DATA" --epochs "$EPOCHS" --batch-size "$batch" --quiet --results-dir "$dir" \
                "${launch[@]}" $ARGS >"$work/log" 2>&1 \
                || { echo "failed:"; tail -n 20 "$work/log" >&2; exit 1; }
            grep -o '([0-9.]*/s' "$work/log" | tail -n 1 | tr -d '(' || echo
        done
    done
done
echo
"$bin/report" scaling --results-dir "$RESULTS"
