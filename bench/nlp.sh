#!/usr/bin/env bash
# `make bench-nlp`: training throughput (tokens/s) of exercise1_nlp against the PyTorch eager
# reference (bench/exercise1_nlp_reference.py): same model, batch, bptt, data and threads,
# run alternately (Rust, PyTorch, Rust, PyTorch, ...) so that both see the same machine state;
# prints the medians and their ratio and appends them to results/bench-nlp.csv (and a row to
# results/bench.csv). It is the `nlp` entry of bench/bench.sh (`make bench`).
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
