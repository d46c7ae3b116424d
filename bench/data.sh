#!/usr/bin/env bash
# `make bench-data`: the input pipeline alone, ours against torchvision's, side by side on the
# same files: images per second from JPEG files to normalised float batches on the CPU (read,
# decode, RandomResizedCrop(224) + flip, normalise, batch), nothing trained. Ours is the loader
# the exercises use (target/release/bench_data: worker threads); torchvision's is
# DataLoader(ImageFolder) with the same transforms and as many worker processes
# (bench/data_loader.py). At WORKERS="1 <all cores>", ROUNDS rounds of A B A B; medians and the
# ratio, and per core: images per CPU-second of all the loader's threads and processes (ours: the
# process; torchvision's: the main process and its workers). Also how far our evaluation transform (Resize(256) + CenterCrop(224)) is from
# torchvision's (PIL's) on the same images. The photographs are generated once into
# data/bench-photos (CLASSES × PER_CLASS JPEGs, 3,000 by default, of about 500×375, quality 90, ~125 KB each, like
# ImageNet's); torchvision and Pillow come from scripts/python-tools. Rows go to
# results/bench-data.csv; a table is printed.
#
#   make bench-data        WORKERS="1 $(nproc)" ROUNDS=2 BATCH=64 BATCHES=36 WARMUP=6 CLASSES=10 PER_CLASS=300
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${TORCH_PYTHON:?run through scripts/with-torch}"
WORKERS="${WORKERS:-1 $(nproc)}"; ROUNDS="${ROUNDS:-2}"; BATCH="${BATCH:-64}"; BATCHES="${BATCHES:-36}"; WARMUP="${WARMUP:-6}"
CLASSES="${CLASSES:-10}"; PER_CLASS="${PER_CLASS:-300}"
bin="${BIN:-target/release}"
photos="data/bench-photos"
csv="results/bench-data.csv"

if [[ ! -f "$photos/train/c$(printf %03d $((CLASSES - 1)))/c$(printf %03d $((CLASSES - 1)))_$(printf %06d $((PER_CLASS - 1))).JPEG" ]]; then
    rm -rf "$photos"
    "$bin/prepare_data" generate-images --out "$photos" --classes "$CLASSES" --train "$PER_CLASS" --val 1 --sizes imagenet
fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT

header="finished_at,loader,workers,batch,images,images_per_s,images_per_cpu_s"
PYTHONPATH=bench python3 -m gpucheck.output header "$csv" "$header"  # refuses a link or a FIFO there, before the first run
common=(--data-dir "$photos" --batch-size "$BATCH")
rust() { "$bin/bench_data" "${common[@]}" --batches "$BATCHES" --warmup "$WARMUP" --workers "$1"; }
torchvision() { "$python" bench/data_loader.py "${common[@]}" --batches "$BATCHES" --warmup "$WARMUP" --workers "$1"; }
# "images/s:images per CPU-second" of a run's JSON line.
rate() { "$python" -c "import json, sys; d = json.loads(sys.stdin.read().strip().splitlines()[-1]); print(f\"{d['images_per_s']}:{d['images'] / d['cpu_seconds']}\")"; }

echo "$(nproc) cores; $((CLASSES * PER_CLASS)) JPEGs in $photos ($(du -sh "$photos" | cut -f1)); batch $BATCH, $BATCHES batches timed after $WARMUP, $ROUNDS rounds A B A B"
echo "| workers | ours (img/s) | torchvision (img/s) | ours / torchvision | ours per CPU-second | torchvision per CPU-second | per core, ours / torchvision |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
for workers in $WORKERS; do
    ours=(); theirs=()
    for _ in $(seq "$ROUNDS"); do
        ours+=("$(rust "$workers" | rate)")
        theirs+=("$(torchvision "$workers" | rate)")
    done
    "$python" - "$csv" "$workers" "$BATCH" "$((BATCH * BATCHES))" "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys, time
sys.path.insert(0, "bench")
from gpucheck import output  # the one writer: never through a link, never into a FIFO
csv, workers, batch, images = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runs = lambda arg: [tuple(float(x) for x in pair.split(":")) for pair in arg.split()]
ours, theirs = runs(sys.argv[5]), runs(sys.argv[6])
output.append(csv, "".join(f"{int(time.time())},{name},{workers},{batch},{images},{rate:.1f},{per_cpu:.1f}\n"
                            for name, rates in (("rust", ours), ("torchvision", theirs)) for rate, per_cpu in rates))
median = lambda rates, i: statistics.median(r[i] for r in rates)
a, b, ca, cb = median(ours, 0), median(theirs, 0), median(ours, 1), median(theirs, 1)
each = lambda rates: ", ".join(f"{r[0]:.0f}" for r in rates)
print(f"| {workers} | {a:.0f} ({each(ours)}) | {b:.0f} ({each(theirs)}) | {a / b:.2f}× | {ca:.0f} | {cb:.0f} | {ca / cb:.2f}× |")
PY
done
"$bin/bench_data" "${common[@]}" --workers 1 --batches 1 --warmup 0 --dump "$work/eval.f32" > /dev/null
"$python" bench/data_loader.py "${common[@]}" --workers 0 --compare "$work/eval.f32"
