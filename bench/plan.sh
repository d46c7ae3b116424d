#!/usr/bin/env bash
# `make bench-plan`: the layout planner's predictions against runs. bench-parallel's Transformer
# (bench/transformer.sh: d 256, d_hid 1024, 8 heads, 4 layers, the real WikiText-2 valid split
# as training text, the vocabulary padded to a multiple of 128) on NPROC CPU ranks at one global
# batch (GLOBAL streams of 35 tokens):
#   1. `exercise3 profile` over the job's ranks, with the runs' threads (THREADS);
#   2. `exercise3 plan --json`: every legal layout, those that fit in MEMORY per rank ranked;
#   3. every one of them run for STEPS steps (the first 2 not timed; 10 timed, since this VM's
#      speed wanders by a third from one second to the next and 4 timed steps averaged it over
#      about one second) as the plan's row says,
#      REPEAT times (the second time in the reverse order), then the machine profiled again;
#   4. per run the predicted (from each profile) and measured step time and the busiest rank's
#      peak memory (bytes held by tensors in training over what they held before) appended to
#      results/bench-plan.csv (replacing that cluster's previous bench: older ones are in its
#      git history), and `report plan` summarizes the newest run of each cluster:
#      time errors (median and worst; a layout's mean run against the mean of its two
#      predictions), memory errors, where the measured-fastest layout stood in the plan,
#      Spearman's rank correlation, and the bench's own noise (a layout's runs apart, the two
#      profiles' predictions apart); chart results/bench-plan.svg.
# HOSTS=2 runs it across two hosts: network namespaces on this machine (scripts/lib/hosts.sh,
# root), NPROC/2 ranks on each started by `mpirun -H`, the link between them shaped to
# LINK_RATE (tc tbf); the profile then measures that link too, finds the hosts one machine
# (one kernel) and measures the sharing of its cores over all their ranks, and the plan takes
# the hosts' ranks as sharing those cores, as the profile says.
#
#   make bench-plan                         HOSTS=1 NPROC=4 GLOBAL=16 STEPS=12 THREADS=1 MEMORY=1GiB REPEAT=2
#   make bench-plan HOSTS=2 LINK_RATE=1gbit
#   make bench-plan SAMPLE=3                 the plan's best 3, then every 3rd layout of its ranking
#   make bench-plan REPEAT=1                 each layout once, one profile (half the time; no noise figures)
#
# Not a test: the ranks share this machine's cores, and the runs are timed while nothing else
# runs (run it alone).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HOSTS="${HOSTS:-1}"; NPROC="${NPROC:-4}"; GLOBAL="${GLOBAL:-16}"; STEPS="${STEPS:-12}"; THREADS="${THREADS:-1}"
MEMORY="${MEMORY:-1GiB}"; LINK_RATE="${LINK_RATE:-1gbit}"; SAMPLE="${SAMPLE:-1}"; REPEAT="${REPEAT:-2}"
bin="$root/${BIN:-target/release}"
csv="results/bench-plan.csv"
[[ "$HOSTS" == 1 || "$HOSTS" == 2 ]] || { echo "error: HOSTS=$HOSTS: 1 or 2" >&2; exit 2; }
((NPROC % HOSTS == 0)) || { echo "error: NPROC=$NPROC ranks do not divide over HOSTS=$HOSTS" >&2; exit 2; }
[[ "$SAMPLE" =~ ^[1-9][0-9]*$ ]] || { echo "error: SAMPLE=$SAMPLE: a whole number of 1 or more" >&2; exit 2; }
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || { echo "error: REPEAT=$REPEAT: a whole number of 1 or more" >&2; exit 2; }
((STEPS > 2)) || { echo "error: STEPS=$STEPS: the first 2 steps are not timed, so at least 3" >&2; exit 2; }
# shellcheck source=bench/transformer.sh
source "$root/bench/transformer.sh"
per_host=$((NPROC / HOSTS))
cluster="${HOSTS}x${per_host}"

if ((HOSTS > 1)); then
    source "$root/scripts/lib/hosts.sh"
    why="$(hosts_can)" || { echo "error: HOSTS=$HOSTS needs network namespaces: $why" >&2; exit 2; }
    export HOSTS_PREFIX="bp$((RANDOM % 10000))"
    trap 'hosts_down; rm -rf "$work"' EXIT
    HOSTS_NET="$((100 + RANDOM % 100))" hosts_up "$HOSTS_PREFIX" "$HOSTS"
    for ((h = 1; h <= HOSTS; h++)); do link_rate "node$h" "$LINK_RATE"; done
    cluster="$cluster over $LINK_RATE"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    placement="node1:$per_host"
    for ((h = 2; h <= HOSTS; h++)); do placement+=",node$h:$per_host"; done
    # launch BINARY ARGS...: the job's ranks, per_host on each host, from node1.
    launch() {
        on_host node1 "$root/scripts/with-torch" mpirun --mca plm_rsh_agent "$root/scripts/lib/host-agent" \
            --oversubscribe --bind-to none -x LD_LIBRARY_PATH -H "$placement" -np "$NPROC" "$@"
    }
else
    launch() { "$@" --nproc-per-node "$NPROC"; }
fi

# The run's vocabulary (the profile is of the model the runs train): what the tokenizer makes of
# the training text, padded as the runs pad it.
"$bin/exercise1_nlp" --device cpu --data-dir "$work/data" "${model[@]}" --pad-vocab 128 --estimate-memory \
    --results-dir "$work/vocab" > "$work/vocab.log" 2>&1 \
    || { echo "error: exercise1_nlp --estimate-memory failed:" >&2; tail -n 20 "$work/vocab.log" >&2; exit 1; }
vocab="$(sed -n 's/^Transformer LM: .*, vocabulary \([0-9]*\);.*/\1/p' "$work/vocab.log")"
[[ -n "$vocab" ]] || { echo "error: no vocabulary in exercise1_nlp's output:" >&2; cat "$work/vocab.log" >&2; exit 1; }

echo "profile: $cluster ranks, d 256, vocabulary $vocab, $THREADS thread(s) per rank"
# profile OUT: the machine measured for the plan, the model's flags (one layer is timed and the
# plan stacks them; the optimizer is timed over the model's layers).
profile() {
    launch "$bin/exercise3" profile --out "$1" "${model[@]}" --vocab "$vocab" --pad-vocab 128 \
        --micro-batches 1,2,4,8,16 --threads "$THREADS" --max-message-mb 64 > "$work/profile.log" 2>&1 \
        || { echo "error: exercise3 profile failed:" >&2; tail -n 20 "$work/profile.log" >&2; exit 1; }
}
profile "$work/profile.json"
cp "$work/profile.json" "results/bench-plan-profile-${cluster%% *}.json"
# plan PROFILE ARGS...: the plan for the job the profile was taken on.
plan() {
    "$bin/exercise3" plan --profile "$1" --nodes "$HOSTS" --gpus-per-node "$per_host" --memory "$MEMORY" \
        --global-batch "$GLOBAL" --nlayers 4 "${@:2}"
}
plan "$work/profile.json" --json > "$work/plan.json"
plan "$work/profile.json" --top 5
mapfile -t rows < <(python3 -c 'import json,sys
for p in json.load(open(sys.argv[1]))["ranked"]:
    print("\t".join(map(str, [p["command"], p["step_s"], p["memory_bytes"], p["compute_s"], p["tp_comm_s"], p["bubble_s"], p["exposed_comm_s"], p["optimizer_s"]])))' "$work/plan.json")
selected=()
for ((rank = 1; rank <= ${#rows[@]}; rank++)); do
    ((rank <= 3 || (rank - 1) % SAMPLE == 0)) && selected+=("$rank")
done
echo "running ${#selected[@]} of the ${#rows[@]} layouts that fit in $MEMORY (SAMPLE=$SAMPLE: the best 3, then every ${SAMPLE}th), $STEPS steps each, $REPEAT time(s)"

header="bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,predicted_memory_bytes,measured_memory_bytes,compute_s,tp_comm_s,bubble_s,exposed_comm_s,optimizer_s,pass,predicted_step_s_after"
if [[ -f "$csv" && "$(head -n 1 "$csv")" != "$header" ]]; then
    mv "$csv" "$csv.$(date +%s).old"; echo "note: $csv had other columns; moved it aside" >&2
fi
PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "$header"  # refuses a link or a FIFO there, before the first run
started="$(date +%s)"
# Each pass runs the layouts in the other order, so that a slow spell of the machine does not
# fall on the same layouts' runs; the bench's rows wait in $work/rows until the profile after.
for ((pass = 1; pass <= REPEAT; pass++)); do
    order=("${selected[@]}")
    ((pass % 2 == 1)) || mapfile -t order < <(printf '%s\n' "${selected[@]}" | tac)
    for rank in "${order[@]}"; do
        IFS=$'\t' read -r command predicted memory rest <<< "${rows[rank - 1]}"
        read -r -a flags <<< "$command"
        rm -rf "$work/run"
        if ! launch "$bin/${flags[0]}" "${flags[@]:1}" "${transformer_flags[@]}" --pad-vocab 128 --max-steps "$STEPS" \
            --results-dir "$work/run" > "$work/run.log" 2>&1; then
            echo "error: #$rank $command failed:" >&2; tail -n 20 "$work/run.log" >&2; exit 1
        fi
        python3 - "$work/run" "$work/rows" "$started" "$cluster" "$rank" "$command" "$predicted" "$memory" "$rest" "$pass" <<'PY'
import glob, json, sys
run, rows, started, cluster, rank, command, predicted, memory, rest, run_pass = sys.argv[1:]
d = json.load(open(glob.glob(f"{run}/*-cpu.json")[0]))
step = d["global_batch"] * d["bptt"] / d["steady_throughput"]
held = max(p["training_peak_bytes"] - p["baseline_bytes"] for p in d["peak_memory"])
row = [started, f'"{cluster}"', rank, f'"{command}"', predicted, f"{step:.6f}", memory, held] + rest.split("\t") + [run_pass]
open(rows, "a").write(",".join(map(str, row)) + ",\n")
print(f"#{rank} {command} (run {run_pass}): predicted {float(predicted):.3f} s, measured {step:.3f} s ({float(predicted) / step - 1:+.0%}); "
      f"memory predicted {float(memory) / 2**20:.1f} MiB, measured {held / 2**20:.1f} MiB ({float(memory) / held - 1:+.0%})")
PY
    done
done
# Run more than once, the machine is profiled again: the two profiles' predictions apart say how
# far the profile itself moves in the bench's time.
if ((REPEAT > 1)); then
    echo "profile again, after the runs"
    profile "$work/profile-after.json"
    plan "$work/profile-after.json" --json > "$work/plan-after.json"
fi
python3 - "$work/rows" "$work/plan-after.json" "$csv" <<'PY'
import csv, io, json, os, sys
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
rows, after, out = sys.argv[1:]
predicted = {p["command"]: p["step_s"] for p in json.load(open(after))["ranked"]} if os.path.exists(after) else {}
lines, clusters = [], set()
for line in open(rows).read().splitlines():
    fields = next(csv.reader(io.StringIO(line)))
    clusters.add(fields[1])
    lines.append(line + (str(predicted[fields[3]]) if fields[3] in predicted else "") + "\n")
# The table keeps the newest bench of each cluster: this one replaces its cluster's last
# (the older benches stay in the file's git history).
header, *kept = open(out).read().splitlines(keepends=True)
kept = [line for line in kept if next(csv.reader(io.StringIO(line)))[1] not in clusters]
output.write(out, header + "".join(kept) + "".join(lines))
PY
"$bin/report" --results-dir results plan
