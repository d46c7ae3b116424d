# The front door. Every target that builds or runs goes through scripts/with-torch, which
# finds (or installs, once, into .venv) PyTorch 2.11.0 and sets the LibTorch environment.
#
#   make exercise1          CPU vs GPU table for the course's CNN on CIFAR-10
#   make exercise1 ARGS="--model resnet34 --max-steps 20"
#   make check              lint and the fast tests (make test: all of them)
#   make test
#
# Use an existing PyTorch 2.11.0 instead of .venv:  make TORCH_PYTHON=/path/to/python ...
# or an unpacked LibTorch 2.11.0:                   make LIBTORCH=/path/to/libtorch ...

SHELL     := bash
WITH      := scripts/with-torch
CARGO     := $(WITH) cargo
BIN       := target/release
ARGS      ?=
export TORCH_PYTHON LIBTORCH

.PHONY: bench-plan test-cluster gpu-bundle exercise1-imagenet data-imagefolder lint system-deps python-tools gpu-check report scaling exercise2 exercise3-ddp exercise3-pipeline exercise3-tp bench-parallel bench bench-allreduce bench-pipeline bench-largebatch bench-ps bench-checkpoint bench-data setup build data data-cifar10 data-mnist data-wikitext2 exercise1 exercise1-cpu exercise1-gpu \
        exercise1_nlp exercise1_nlp-cpu exercise1_nlp-gpu bench-nlp check test test-hostile test-isa test-slurm clean-results \
        notebooks notebook-kernel jupyter

system-deps:
	@scripts/system-deps

setup: system-deps
	@$(WITH) true
	@$(WITH) sh -c 'echo "LibTorch: PyTorch $$TORCH_VERSION"'

build: setup
	$(CARGO) build --release --workspace

data: build
	PREPARE_DATA=$(BIN)/prepare_data $(WITH) scripts/fetch_data.sh cifar10 mnist
	PREPARE_DATA=$(BIN)/prepare_data $(WITH) scripts/fetch_wikitext.sh

data-cifar10: build
	PREPARE_DATA=$(BIN)/prepare_data $(WITH) scripts/fetch_data.sh cifar10

data-mnist: build
	PREPARE_DATA=$(BIN)/prepare_data $(WITH) scripts/fetch_data.sh mnist

data-wikitext2: build
	PREPARE_DATA=$(BIN)/prepare_data $(WITH) scripts/fetch_wikitext.sh

exercise1: data-cifar10
	$(WITH) $(BIN)/exercise1 --device both $(ARGS)

exercise1-cpu: data-cifar10
	$(WITH) $(BIN)/exercise1 --device cpu $(ARGS)

exercise1-gpu: data-cifar10
	$(WITH) $(BIN)/exercise1 --device cuda $(ARGS)

# The JSC exercise: ResNet50 on an ImageNet-style image folder (IMAGENET=/path/to/imagenet with
# train/<class>/ and val/<class>/; default a generated stand-in, data/imagefolder), the course's
# Resize((256, 256)), CPU then GPU as exercise1; on a cluster, sbatch/resnet50_imagenet.sbatch.
IMAGENET ?= data/imagefolder
exercise1-imagenet: $(if $(filter data/imagefolder,$(IMAGENET)),data-imagefolder,build)
	$(WITH) $(BIN)/exercise1 --device both --model resnet50 --dataset imagefolder --transform resize --data-dir $(IMAGENET) $(ARGS)

# A generated stand-in image folder (10 classes × 100 train + 20 val JPEGs of ImageNet's sizes),
# marked GENERATED: there is no ImageNet to download without an account.
data-imagefolder: build
	@test -f data/imagefolder/GENERATED.txt || $(WITH) $(BIN)/prepare_data generate-images --out data/imagefolder

exercise1_nlp: data-wikitext2
	$(WITH) $(BIN)/exercise1_nlp --device both $(ARGS)

exercise1_nlp-cpu: data-wikitext2
	$(WITH) $(BIN)/exercise1_nlp --device cpu $(ARGS)

exercise1_nlp-gpu: data-wikitext2
	$(WITH) $(BIN)/exercise1_nlp --device cuda $(ARGS)

# Data parallel: 2 local ranks through mpirun (on the GPUs where there are two, else CPU).
NPROC ?= 2
exercise2: data-cifar10
	$(WITH) $(BIN)/exercise2 --nproc-per-node $(NPROC) $(ARGS)

exercise3-ddp: data-cifar10
	$(WITH) $(BIN)/exercise3 ddp --nproc-per-node $(NPROC) $(ARGS)

# Pipeline parallel: the 1.4B-parameter Transformer over the GPUs (cuda:0,cuda:1; both stages on
# the one GPU; or cpu,cpu). On a CPU, try a smaller model:
#   make exercise3-pipeline ARGS="--device cpu --emsize 256 --d-hid 256 --nlayers 4 --max-steps 50"
exercise3-pipeline: data-wikitext2
	$(WITH) $(BIN)/exercise3 pipeline $(ARGS)

# Tensor parallelism (Megatron-LM): every layer of the Transformer cut over NPROC ranks (the
# GPUs where there are enough, else CPU ranks); --pp and --dp add stages and replicas. On a CPU:
#   make exercise3-tp ARGS="--device cpu --emsize 256 --d-hid 256 --nlayers 2 --max-steps 20 --pad-vocab 128"
exercise3-tp: data-wikitext2
	$(WITH) $(BIN)/exercise3 tp --nproc-per-node $(NPROC) $(ARGS)

# Sequential vs 2-stage pipeline time per mini-batch over chunks 1…16, bubble vs theory.
bench-pipeline: build
	$(WITH) $(BIN)/bench_pipeline $(ARGS)

# All-reduce bandwidth (4 KB … 256 MB) and 1 vs NPROC ranks training throughput.
bench-allreduce: data-cifar10
	NPROC=$(NPROC) $(WITH) bench/allreduce.sh

# Rust against every PyTorch peer a user would pick (eager with the default and the fused
# optimizer, channels-last, torch.compile; with CUDA_GRAPH=1 PyTorch's CUDA-graph peers), side by
# side in rotated rounds: exercise1's cnn, resnet34 and vgg19 (images/s) and exercise1_nlp
# (tokens/s); medians, spreads, the ratio against the fastest peer, results/bench.csv. Settings:
# BENCH, ROUNDS, PEERS, CUDA_GRAPH, THREADS, DEVICE, PRECISION, *_STEPS, LOADER, WORKERS (see
# bench/bench.sh).
bench: data-cifar10 data-wikitext2
	$(WITH) bench/bench.sh

# The input pipeline alone, ours vs torchvision's DataLoader(ImageFolder), side by side A B A B:
# images/s from generated ImageNet-like JPEGs to normalised batches (decode, RandomResizedCrop,
# flip), at WORKERS="1 <all cores>"; how close our eval transform is to PIL's; torchvision and
# Pillow from python-tools; results/bench-data.csv (see bench/data.sh).
bench-data: build python-tools
	$(WITH) bench/data.sh

# Large batches on CPU ranks: effective batches 100, 800, 3,200 (--accumulate), plain vs scaled
# learning rate with warm-up vs LARS, test accuracy after the same samples (real MNIST sample;
# NPROC, BATCH, EPOCHS, LR, WARMUP, MODEL); results/bench-largebatch.csv.
bench-largebatch: build
	$(WITH) bench/largebatch.sh

# All-reduce vs synchronous vs asynchronous (and bounded-staleness) parameter servers on CPU
# ranks, worker 1 a straggler: throughput and test accuracy after the same samples (real MNIST
# sample; WORKERS, SERVERS, BATCH, EPOCHS, LR, STRAGGLE, K); results/bench-ps.csv and .svg.
bench-ps: build
	$(WITH) bench/ps.sh

# DP, ZeRO-1/2/3, TP, TP with sequence parallelism, PP, two 2-D layouts and HSDP on NPROC=4 CPU ranks at one global batch: time per
# step, bytes handed to each kind of collective, model state per rank beside ZeRO's formulas;
# results/bench-parallel.csv (NPROC, GLOBAL, STEPS, THREADS, DATA).
bench-parallel: build
	$(WITH) bench/parallel.sh

# The layout planner against runs: bench-parallel's Transformer profiled on NPROC=4 CPU ranks,
# planned (exercise3 plan), and every layout that fits in MEMORY run for STEPS steps, REPEAT=2
# times, then profiled again; predicted and measured step time and peak memory into
# results/bench-plan.csv, summarized with the bench's own noise and results/bench-plan.svg
# (report plan). HOSTS=2: across two hosts (network namespaces, root), the link between them
# shaped to LINK_RATE. Settings: HOSTS, NPROC, GLOBAL, STEPS, THREADS, MEMORY, LINK_RATE,
# SAMPLE, REPEAT, DATA (see bench/plan.sh).
bench-plan: build
	$(WITH) bench/plan.sh

# What checkpointing costs training: checkpoints every EVERY=2 of STEPS=12 steps of bench-parallel's
# Transformer on NPROC=4 CPU ranks (dp, ZeRO-3, tp, pp), each as one file and sharded: bytes
# through rank 0, training time blocked per checkpoint, background write time, step time;
# results/bench-checkpoint.csv.
bench-checkpoint: build
	$(WITH) bench/checkpoint.sh

# The scaling study (JSC's, Namal's and IDRIS's slides): EXERCISE at RANKS="1 2 4" local ranks,
# the global batch held (strong, GLOBAL=128) and the batch per rank held (weak, PER_RANK=32);
# MODE=strong|weak|both (WEAK=1 = MODE=weak), PRECISION="32 bf16-mixed" for FP32 vs mixed;
# runs in results/scaling/, the table in results/scaling.csv, the chart results/scaling.svg
# (see bench/scaling.sh; across nodes: sbatch/scaling.sbatch).
scaling: build
	$(WITH) bench/scaling.sh

# exercise1_nlp alone (ROUNDS, STEPS, THREADS, DEVICE, MODEL_FLAGS); also results/bench-nlp.csv.
bench-nlp: data-wikitext2
	$(WITH) bench/nlp.sh

# Every GPU path on this machine's GPU(s) (bench/gpu_check.py), in tiers of at most 6 minutes on an
# H200: the multi-rank paths against one rank (over NCCL; ranks beyond the GPUs share one), every
# exercise in every precision, the speed features equal to the plain path, side-by-side timings
# against every PyTorch peer (3 rounds), memory, the 1.4B model's MFU, the planner; the table in
# results/gpu-check.md and .json, every row with its own GPU, commit and date. ARGS: --tier N,
# --next, --tiers, --only PATTERN, --no-timings, --keep. Without a GPU: one line, exit 2.
# From prebuilt binaries (no Rust on the GPU node), see docs/gpu-bundle.md.
gpu-check: build
	$(WITH) sh -c '"$$TORCH_PYTHON" bench/gpu_check.py $(ARGS)'

# The folder that checks this commit on a bare GPU node (no Rust, no network, 64 MiB at most):
# stripped binaries, the MPI they load, bench/, run.sh and the committed table (scripts/gpu-bundle).
# On the node:
#   .gpu-bundle/run.sh --next --out results        (--device cpu --tier N: a tier's self-test, anywhere)
gpu-bundle: build
	$(WITH) scripts/gpu-bundle

# Python packages the tests read our outputs with (TensorBoard's event reader; torchvision and
# Pillow for the image-file loader's checks), into .venv.
python-tools: setup
	$(WITH) scripts/python-tools

# Every test in a process of its own (cargo-nextest): LibTorch's random generator, thread counts
# and autocast state are process-wide, so tests run side by side as threads of one process could
# draw from each other's random streams. Without nextest: one test at a time (slower).
# rustfmt (rustfmt.toml) and clippy with warnings as errors, as CI holds them (part of make test).
lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	python3 scripts/module-cycles.py

# nextest runs as many tests at once as there are cores. Each test's LibTorch would start an
# OpenMP team of one thread per core, and the teams spin-wait against each other: one thread per
# test process (a rank of a multi-rank test takes its share of the cores anyway). Measured on 2
# cores: the suite 615 -> 516 s, its longest test 185 -> 88 s. A setting of yours is kept.
# The hostile-input test (exercises/tests/hostile.rs, several minutes) is `make test-hostile`.
test: build python-tools lint
	@if cargo nextest --version >/dev/null 2>&1; then \
	    OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(CARGO) nextest run --release --workspace --no-fail-fast -E 'not binary_id(exercises::hostile)'; \
	else \
	    echo ">> cargo-nextest not found: running the tests one at a time (cargo install cargo-nextest for a faster make test)"; \
	    $(CARGO) test --release --workspace --no-fail-fast -- --test-threads 1 --skip every_argument; \
	fi

# Every flag and positional of every binary, read from the binary's own description, given 0,
# -1, NaN, inf, 1e30, a string that is not UTF-8, an empty string, and where a path is expected
# a FIFO, a folder and a link: each run ends in time with one error line or is accepted, never a
# panic, an abort or a hang; each test prints its counts (docs/tests.md). CI runs it after make test.
test-hostile: build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(CARGO) nextest run --release -p exercises --test hostile --no-fail-fast --success-output final

# The fast tier: lint, the unit tests and the quick single-process integration tests, without
# the groups .config/nextest.toml names (multi-rank: tests that start ranks; long: tests that
# train to a bar, time, or build the GPU bundle). Under 5 minutes after the build on 2 cores;
# `make test` runs everything (docs/tests.md).
check: build python-tools lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(CARGO) nextest run --release --workspace --no-fail-fast -E 'not (group(multi-rank) | group(long))'

# The tests whose bars rest on floating-point arithmetic (learning, precision, layouts compared
# within a tolerance) under every CPU path this machine has: OMP_NUM_THREADS 1 and 2 ×
# ATEN_CPU_CAPABILITY unset and avx2 × ONEDNN_MAX_CPU_ISA AVX2 … AMX (scripts/test-isa). Not part
# of `make test` (12 passes of about 66 tests: 54 minutes on 2 cores).
test-isa: build
	$(WITH) scripts/test-isa

# The sbatch/ scripts through a real one-node Slurm on this machine (root; installs Debian's
# slurm-wlm and munge when missing): every script submitted with CPU overrides and tiny data,
# exit codes and outputs checked. Not part of `make test` (a few minutes; see docs/tests.md).
test-slurm: build
	scripts/test-slurm

# A multi-host Slurm cluster on this machine (root; network namespaces as hosts, a slurmd on each,
# links shaped with tc): the multi-node sbatch scripts across 2 and 4 nodes, each rank's host and
# the numbers checked against one node. Not part of `make test` (its two-host launch check is).
# NODES=4 and LINK_RATE=1gbit by default.
test-cluster: build
	scripts/test-cluster --nodes $(or $(NODES),4) --link-rate $(or $(LINK_RATE),1gbit)

# The evcxr notebooks (notebooks/*.ipynb): builds the Rust Jupyter kernel (evcxr_jupyter, pinned)
# and installs Jupyter's runner into .venv, then executes every notebook headless (nbconvert
# --execute) into target/notebooks/, failing on any cell error. NOTEBOOKS=path.ipynb runs one.
notebooks: build data-cifar10 data-wikitext2
	$(WITH) scripts/notebooks run $(NOTEBOOKS)

# The kernel alone, for JupyterLab or a cluster's Jupyter service; KERNEL_USER=1 installs it for
# your user too (~/.local/share/jupyter/kernels, where Open OnDemand's Jupyter looks).
notebook-kernel: setup
	$(WITH) scripts/notebooks kernel

# JupyterLab (pinned) from .venv on this machine, with the kernel, serving notebooks/; ARGS go
# to Jupyter (e.g. ARGS="--port 8899 --ip 0.0.0.0").
jupyter: build data-cifar10 data-wikitext2
	$(WITH) scripts/notebooks lab $(ARGS)

# The tables and charts of the last runs in results/ into results/README.md (generated section).
report: build
	$(WITH) $(BIN)/report --results-dir results

# Run logs only; the committed reference results stay.
clean-results:
	rm -f results/exercise*.csv results/*.old
