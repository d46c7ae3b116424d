"""The timing tiers: our throughput side by side with every PyTorch peer a user would pick
(bench/bench.sh: eager with the optimizer's default implementation and fused, channels-last for
the conv nets, torch.compile; with --cuda-graph, PyTorch's CUDA-graph peers; the Lightning
Trainer), a warm-up run of each side first, then 3 rounds, A B A B. A row gives our median and
spread, every peer's median, the fastest peer, the ratio against it (the one the goals hold) and
each side's per-phase breakdown (kept whole in the row's `extra`). Against the JPEG files:
PyTorch fed by torchvision's DataLoader(ImageFolder)."""
import csv
import json
import os
import subprocess

from . import output
from .harness import BENCH, CheckFailed, tail
from .table import PASS, BELOW
from .tiers import TIMINGS

ROUNDS = 3
# Least ratio to the fastest peer per (entry, kind of run).
GOALS = {"cnn": 1.0, "resnet34": 1.1, "vgg19": 1.1, "nlp": 1.0}
GRAPH_GOAL = 1.0  # our --cuda-graph against PyTorch's graph peers
ENTRY_NAMES = {"cnn": "exercise1 cnn", "resnet34": "exercise1 resnet34", "vgg19": "exercise1 vgg19", "nlp": "exercise1_nlp"}
# Seconds one timed run of an entry takes on an H200 (start-up, warm-up steps, 2 s of steady
# state), and what torch.compile adds to a peer's first run and to each later one (inductor's
# caches on disk): from the table of 2026-11-28 (22 runs in 129 s) and ResNet34's 52 s warm-up.
RUN_SECONDS = {"cnn": 4, "resnet34": 7, "vgg19": 7, "nlp": 5}
COMPILE_SECONDS = {"cnn": (30, 8), "resnet34": (52, 15), "vgg19": (60, 15), "nlp": (40, 10)}
# The peers bench.sh runs on a GPU by default, per entry (eager always), and with CUDA_GRAPH=1.
GPU_PEERS = {"cnn": 5, "resnet34": 5, "vgg19": 5, "nlp": 3}  # eager, fused (, channels-last, channels-last-fused), compile
GRAPH_PEERS = "eager fused reduce-overhead cuda-graph"


def estimate(entry, sides, compiled):
    """(GPU, CPU) seconds of a timing of `entry` with `sides` sides per round (ours included)
    and `compiled` of them compiled by inductor, a warm-up and ROUNDS rounds."""
    runs = (1 + ROUNDS) * sides
    first, later = COMPILE_SECONDS[entry]
    return runs * RUN_SECONDS[entry] + compiled * (first + ROUNDS * later), 60


def plan(h):
    if h.args.no_timings:
        return
    for precision in ["32", "bf16-mixed"]:
        for entry in ["cnn", "nlp", "resnet34", "vgg19"]:
            # The CPU self-test times the small entries: ResNet34's and VGG19's steps take seconds
            # each there (the CPU's own comparison is make bench).
            needs = "CUDA (on the CPU, make bench)" if h.cpu and entry in ("resnet34", "vgg19") else None
            h.check(f"timing {ENTRY_NAMES[entry]} {precision}: every PyTorch peer", lambda p=precision, e=entry: bench(h, p, e, graph=False),
                    TIMINGS[(precision, entry)], estimate(entry, 1 + GPU_PEERS[entry], 1), needs)
    for entry in ["cnn", "nlp"]:
        h.check(f"timing {ENTRY_NAMES[entry]} 32 --cuda-graph: PyTorch's CUDA-graph peers", lambda e=entry: bench(h, "32", e, graph=True),
                TIMINGS[("32 --cuda-graph", entry)], estimate(entry, 6, 1), h.needs_cuda())
    h.check("timing exercise1 cnn 32: the pytorch-lightning Trainer", lambda: lightning(h), TIMINGS[("32", "lightning")], estimate("cnn", 3, 0),
            None if has_lightning(h) else "pytorch_lightning")
    h.check(f"timing exercise1 resnet50 from JPEG files, batch {4 if h.cpu else 256}: against PyTorch + torchvision's DataLoader", lambda: jpeg(h),
            TIMINGS[("32", "resnet50 jpeg")], (90, 30))


def run_bench(h, precision, entry, graph, peers=None):
    """bench/bench.sh for one entry; its CSV rows."""
    csv_path = os.path.join(h.work, f"bench-{precision}-{entry}-{graph}-{peers or 'all'}.csv")
    env = dict(h.env, DEVICE=h.device, PRECISION=precision, BENCH=entry, ROUNDS=str(ROUNDS), BIN=h.bin, BENCH_CSV=csv_path, CUDA_GRAPH="1" if graph else "0",
               TORCH_PYTHON=h.python, CIFAR_DIR=h.cifar_full(), WIKITEXT_DIR=h.wikitext, CNN_STEPS="30" if not h.cpu else "4", RESNET34_STEPS="15",
               VGG19_STEPS="10", NLP_STEPS="15" if not h.cpu else "4", MIN_SECONDS="2" if not h.cpu else "0.2", BENCH_NOTE="gpu-check")
    if h.cpu:
        # The CPU self-test: the harness's machinery (rotated rounds, medians, the fastest peer),
        # at a size and a count of runs a CPU does in seconds; its figures mean nothing.
        env.update(NLP_MODEL_FLAGS="--emsize 64 --d-hid 64 --nlayers 1 --nhead 2", ROUNDS="2", WARM="0")
    if peers is not None:
        env["PEERS"] = peers
    elif h.cpu:
        env["PEERS"] = "fused"  # the CPU self-test: the peers' machinery, not their speed
    code, out, err, _ = h.spawn(["bash", os.path.join(BENCH, "bench.sh")], env=env)
    output.write(csv_path + ".log", out + err)
    if code != 0:
        raise CheckFailed(f"bench.sh: {tail(err, 3)}")
    with open(csv_path) as f:
        return list(csv.DictReader(f))


def number(row, key):
    value = row.get(key)
    return float(value) if value not in (None, "") else None


def phases(row, side):
    parts = [(name, number(row, f"{side}_{key}_ms")) for name, key in [("data", "data"), ("fwd+bwd", "fwd_bwd"), ("optimizer", "optim"), ("replay", "replay")]]
    return ", ".join(f"{name} {ms:.2f}" for name, ms in parts if ms is not None)


def describe(row):
    """Ours against the fastest peer and every peer, with spreads and phases."""
    unit = row["unit"]
    ours = f"ours {number(row, 'rust_throughput'):,.0f} ({number(row, 'rust_min'):,.0f}-{number(row, 'rust_max'):,.0f})"
    fastest = (f"fastest peer {row['fastest_peer']} {number(row, 'fastest_peer_throughput'):,.0f} "
               f"({number(row, 'fastest_peer_min'):,.0f}-{number(row, 'fastest_peer_max'):,.0f}) {unit}, {row['rounds']} rounds")
    others = []
    for peer in (row.get("peers") or "").split():
        stem = "pytorch" if peer == "eager" else ("lightning" if peer == "lightning" else "pytorch_" + peer.replace("-", "_"))
        value = number(row, f"{stem}_throughput")
        if value is not None:
            others.append(f"{peer} {value:,.0f}")
    failed = f"; failed: {row['peers_failed']}" if row.get("peers_failed") else ""
    split = f"; ms/step ours {phases(row, 'rust')}, {row['fastest_peer']} {phases(row, 'fastest_peer')}"
    return f"{ours} vs {fastest}; peers {', '.join(others)}{failed}{split}"


def bench(h, precision, entry, graph):
    rows = run_bench(h, precision, entry, graph, peers=GRAPH_PEERS if graph and not h.cpu else None)
    mode = "cuda-graph" if graph else "eager"
    mine = [r for r in rows if r.get("rust_mode", "eager") == mode]
    if not mine:
        raise CheckFailed(f"bench.sh wrote no {mode} row for {entry}")
    row = mine[0]
    goal = GRAPH_GOAL if graph else GOALS[entry]
    ratio = number(row, "ratio_fastest")
    if ratio is None:
        raise CheckFailed(f"no ratio against the fastest peer in bench.sh's row: {sorted(k for k, v in row.items() if v)[:12]}")
    path = f"timing {ENTRY_NAMES[entry]} {precision}{' --cuda-graph' if graph else ''}"
    verdict = PASS if ratio >= goal else BELOW
    return [{"path": path, "verdict": verdict, "figure": f"{describe(row)} (goal {goal:.1f}x the fastest peer)", "ratio": ratio, "extra": row}]


_LIGHTNING = {}


def has_lightning(h):
    """Whether the node's Python has pytorch_lightning (asked once per Python)."""
    if h.python not in _LIGHTNING:
        try:
            probe = subprocess.run([h.python, "-c", "import pytorch_lightning"], capture_output=True, timeout=120, env=h.python_env)
            _LIGHTNING[h.python] = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _LIGHTNING[h.python] = False
    return _LIGHTNING[h.python]


def lightning(h):
    """exercise1's CNN against the same model, data, batch and optimizer trained by
    pytorch-lightning's Trainer (the course's own tool), beside PyTorch eager."""
    row = run_bench(h, "32", "cnn", False, peers="lightning")[0]
    ratio = number(row, "ratio_lightning")
    if ratio is None:
        raise CheckFailed(f"the Lightning peer did not run every round (failed: {row.get('peers_failed') or '?'})")
    figure = (f"ours {number(row, 'rust_throughput'):,.0f} vs Lightning {number(row, 'lightning_throughput'):,.0f} "
              f"({number(row, 'lightning_min'):,.0f}-{number(row, 'lightning_max'):,.0f}) {row['unit']}, {row['rounds']} rounds (goal 1.0x)")
    return [{"path": "timing exercise1 cnn 32 against pytorch-lightning's Trainer", "verdict": PASS if ratio >= 1.0 else BELOW, "figure": figure, "ratio": ratio,
             "extra": row}]


def jpeg(h):
    """Side by side with PyTorch eager fed by torchvision's DataLoader(ImageFolder), as many
    worker processes as our loader's threads, the same model, batch and precision (A B A B)."""
    from .machine import image_file_setup
    batch, steps, side, fast, common, photos = image_file_setup(h)
    workers = str(len(os.sched_getaffinity(0)))
    reference = [h.python, os.path.join(BENCH, "exercise1_reference.py"), "--model", "resnet50", "--loader", "imagefolder", "--data-dir", photos,
                 "--device", h.device, "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--workers", workers,
                 "--steady-after", "2"] + (["--precision", "bf16-mixed", "--channels-last"] if fast else [])
    mine, theirs = [], []
    for round in range(ROUNDS):
        mine.append(h.run(f"r50-files-{round}", "exercise1", [*common, "--dataset", "imagefolder", "--data-dir", photos, "--workers", workers])["json"]["steady_throughput"])
        code, out, err, _ = h.spawn(reference, env=h.python_env)
        if code != 0:
            raise CheckFailed(f"the PyTorch reference failed: {tail(err, 20)}")
        theirs.append(json.loads(out.strip().splitlines()[-1])["steady_throughput"])
    a, b = sorted(mine)[len(mine) // 2], sorted(theirs)[len(theirs) // 2]
    return ((PASS if a >= b else BELOW), f"{a:,.0f} ({min(mine):,.0f}-{max(mine):,.0f}) vs {b:,.0f} ({min(theirs):,.0f}-{max(theirs):,.0f}) images/s, "
            f"{ROUNDS} rounds (goal 1.0x)", a / b)
