# Sourced by bench/parallel.sh and bench/checkpoint.sh: the Transformer both measure (d 256,
# d_hid 1024, 8 heads, 4 layers) and its text: the real WikiText-2 valid split as training text,
# 200 lines of each split to evaluate on (the benches time training steps, and a whole split's
# evaluation would dwarf them). Needs root, NPROC, GLOBAL, STEPS and THREADS; sets work (a
# temporary folder, removed at exit), model and transformer_flags (the flags every run shares;
# each bench adds its --max-steps).
DATA="${DATA:-$root/../shared/data/wikitext-2}"
[[ -f "$DATA/valid.txt" && -f "$DATA/test.txt" ]] || { echo "error: no WikiText-2 valid/test sample in $DATA (set DATA=...)" >&2; exit 2; }
((GLOBAL % NPROC == 0)) || { echo "error: GLOBAL=$GLOBAL streams do not divide over NPROC=$NPROC ranks" >&2; exit 2; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
mkdir -p "$work/data"
cp "$DATA/valid.txt" "$work/data/train.txt"
head -n 200 "$DATA/valid.txt" > "$work/data/valid.txt"; head -n 200 "$DATA/test.txt" > "$work/data/test.txt"
model=(--emsize 256 --d-hid 1024 --nhead 8 --nlayers 4 --dropout 0 --bptt 35)
transformer_flags=(--device cpu --threads "$THREADS" --quiet --data-dir "$work/data" --optimizer adam --lr 1e-4 --epochs 1
                   --steady-after 2 --eval-batch-size 16 "${model[@]}")
