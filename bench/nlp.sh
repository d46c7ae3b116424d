#!/usr/bin/env bash
# `make bench-nlp`: training throughput (tokens/s) of exercise1_nlp against its PyTorch peers
# (bench/exercise1_nlp_reference.py: eager with SGD's default implementation and fused, and the
# others PEERS names): same model, batch, bptt, recipe, data and threads, every side once per
# round with the order rotated, so that all see the same machine state; prints the medians and
# the ratios, appends ours and the eager default peer's to results/bench-nlp.csv (and a row to
# results/bench.csv). It is the `nlp` entry of bench/bench.sh (`make bench`), whose settings apply.
#
#   ROUNDS=3 STEPS=20 THREADS=2 DEVICE=cpu MODEL_FLAGS="--emsize 256 --d-hid 256" make bench-nlp
#
# Run through scripts/with-torch (the Makefile does): it provides TORCH_PYTHON and LibTorch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export BENCH=nlp
export ROUNDS="${ROUNDS:-2}"
export NLP_STEPS="${STEPS:-10}"
export NLP_MODEL_FLAGS="${MODEL_FLAGS:-}"
export NLP_CSV="${NLP_CSV:-results/bench-nlp.csv}"
exec "$root/bench/bench.sh"
