#!/usr/bin/env bash
# `make bench-data`: the input pipeline alone, ours against torchvision's, side by side on the
# same files: images per second from JPEG files to normalised float batches on the CPU (read,
# decode, RandomResizedCrop(224) + flip, normalise, batch), nothing trained. Ours is the loader
# the exercises use (target/release/bench_data: worker threads); torchvision's is
# DataLoader(ImageFolder) with the same transforms and as many worker processes
# (bench/data_loader.py). At WORKERS="1 <all cores>", ROUNDS rounds of A B A B; medians and the
# ratio. Also how far our evaluation transform (Resize(256) + CenterCrop(224)) is from
# torchvision's (PIL's) on the same images. The photographs are generated once into
# data/bench-photos (CLASSES × PER_CLASS JPEGs of about 500×375, quality 90, ~125 KB each, like
# ImageNet's); torchvision and Pillow are installed into .venv when missing. Rows go to
# results/bench-data.csv; a table is printed.
#
#   make bench-data        WORKERS="1 $(nproc)" ROUNDS=2 BATCH=64 BATCHES=12 CLASSES=10 PER_CLASS=100
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${TORCH_PYTHON:?run through scripts/with-torch}"
WORKERS="${WORKERS:-1 $(nproc)}"; ROUNDS="${ROUNDS:-2}"; BATCH="${BATCH:-64}"; BATCHES="${BATCHES:-12}"
CLASSES="${CLASSES:-10}"; PER_CLASS="${PER_CLASS:-100}"
bin="${BIN:-target/release}"
photos="data/bench-photos"
csv="results/bench-data.csv"

TORCHVISION_VERSION=0.26.0; PILLOW_VERSION=13.0.0
if ! "$python" -c "import sys, torchvision, PIL; sys.exit(not torchvision.__version__.startswith('$TORCHVISION_VERSION') or PIL.__version__ != '$PILLOW_VERSION')" 2>/dev/null; then
    echo ">> installing torchvision==$TORCHVISION_VERSION and pillow==$PILLOW_VERSION for $python (the loader compared against)"
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps "torchvision==$TORCHVISION_VERSION" "pillow==$PILLOW_VERSION"
fi
if [[ ! -f "$photos/train/c$(printf %03d $((CLASSES - 1)))/c$(printf %03d $((CLASSES - 1)))_$(printf %06d $((PER_CLASS - 1))).JPEG" ]]; then
    rm -rf "$photos"
    "$bin/prepare_data" generate-images --out "$photos" --classes "$CLASSES" --train "$PER_CLASS" --val 1 --sizes imagenet
fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT

header="finished_at,loader,workers,batch,images,images_per_s"
[[ -f "$csv" ]] || echo "$header" > "$csv"
common=(--data-dir "$photos" --batch-size "$BATCH")
rust() { "$bin/bench_data" "${common[@]}" --batches "$BATCHES" --warmup 2 --workers "$1"; }
torchvision() { "$python" bench/data_loader.py "${common[@]}" --batches "$BATCHES" --warmup 2 --workers "$1"; }
rate() { "$python" -c "import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['images_per_s'])"; }

echo "$(nproc) cores; $((CLASSES * PER_CLASS)) JPEGs in $photos ($(du -sh "$photos" | cut -f1)); batch $BATCH, $BATCHES batches timed after 2, $ROUNDS rounds A B A B"
echo "| workers | ours (img/s) | torchvision (img/s) | ours / torchvision | ours per worker | torchvision per worker |"
echo "|---:|---:|---:|---:|---:|---:|"
for workers in $WORKERS; do
    ours=(); theirs=()
    for _ in $(seq "$ROUNDS"); do
        ours+=("$(rust "$workers" | rate)")
        theirs+=("$(torchvision "$workers" | rate)")
    done
    "$python" - "$csv" "$workers" "$BATCH" "$((BATCH * BATCHES))" "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys, time
csv, workers, batch, images = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ours, theirs = [float(x) for x in sys.argv[5].split()], [float(x) for x in sys.argv[6].split()]
with open(csv, "a") as out:
    for name, rates in (("rust", ours), ("torchvision", theirs)):
        for rate in rates:
            out.write(f"{int(time.time())},{name},{workers},{batch},{images},{rate:.1f}\n")
a, b = statistics.median(ours), statistics.median(theirs)
print(f"| {workers} | {a:.0f} ({', '.join(f'{x:.0f}' for x in ours)}) | {b:.0f} ({', '.join(f'{x:.0f}' for x in theirs)}) | {a / b:.2f}× | {a / workers:.0f} | {b / workers:.0f} |")
PY
done
"$bin/bench_data" "${common[@]}" --workers 1 --batches 1 --warmup 0 --dump "$work/eval.f32" > /dev/null
"$python" bench/data_loader.py "${common[@]}" --workers 0 --batches 1 --warmup 0 --compare "$work/eval.f32" | head -n 1
