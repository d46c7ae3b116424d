#!/usr/bin/env python3
"""`make bench`'s bookkeeping (bench/bench.sh): each run's line in runs.jsonl, and the table and
CSV rows from them.

    bench_report.py record --runs RUNS --entry cnn --side rust --round 1 --rust-json PATH [--others CORES]
    bench_report.py record --runs RUNS --entry cnn --side fused --round 1 --peer-stdout PATH [--others CORES]
    bench_report.py record --runs RUNS --entry cnn --side fused --round 1 --failed "last stderr line"
    bench_report.py table --runs RUNS --csv results/bench.csv [--device cuda ...]

Sides: "rust" (our binary, eager), "rust-graph" (our binary with --cuda-graph), and the PyTorch
peers, named as bench.sh's PEERS names them: eager, fused, channels-last, channels-last-fused,
compile, reduce-overhead, cuda-graph (bench/exercise1_reference.py, bench/exercise1_nlp_reference.py)
and lightning (bench/exercise1_lightning.py). Round 0 is the untimed warm-up and is left out.

One CSV row per entry and Rust mode: "eager" (our eager run against the peers without CUDA
graphs) and, with CUDA_GRAPH=1, "cuda-graph" (our --cuda-graph run against the peers with CUDA
graphs, reduce-overhead and cuda-graph): graph against graph, eager against eager. Every peer
that ran fills its columns in every row; the fastest peer is chosen among the row's kind only.

CSV columns (throughputs are steady-state medians over the rounds, in `unit`; min and max are
the extremes over the rounds; a ratio_* is the median over the rounds of ours / that peer in
the same round, the pairs having run back to back):
  finished_at, exercise, model, device, gpu, precision, rust_layout (nchw or channels-last),
  rust_mode (eager or cuda-graph), threads, steps, rounds, unit, throughput_measure,
  rust_throughput, rust_min, rust_max                 ours
  fastest_peer, fastest_peer_throughput, fastest_peer_min, fastest_peer_max
                                                      the row's fastest peer (highest median) and its figures
  ratio_fastest                                       ours / the fastest peer: the ratio that counts
  pytorch_throughput, pytorch_min, pytorch_max        the eager peer with the optimizer's default implementation
  ratio                                               rust_throughput / pytorch_throughput (the medians' ratio)
  ratio_rounds_median                                 ours / the eager default peer, median of the rounds
  pytorch_<peer>_throughput, _min, _max, ratio_<peer> for <peer> in fused, channels_last, channels_last_fused,
                                                      compile, reduce_overhead, cuda_graph; empty where it did not run
  lightning_throughput, lightning_min, lightning_max, ratio_lightning
  peers                                               the peers that ran every round (PEERS' names)
  peers_failed                                        the peers that failed (excluded; bench.sh printed their stderr)
  params_rust, params_pytorch                         parameter counts (a warning when a peer's differs)
  rust_data_ms, rust_fwd_bwd_ms, rust_optim_ms        ours, per step over all steps: data wait, forward+backward,
                                                      optimizer (with the gradients' clipping)
  pytorch_data_ms, pytorch_fwd_bwd_ms, pytorch_optim_ms          the same for the eager default peer
  fastest_peer_data_ms, fastest_peer_fwd_bwd_ms, fastest_peer_optim_ms, fastest_peer_replay_ms
                                                      the same for the fastest peer; replay: a whole-step CUDA
                                                      graph's replays (forward+backward and optimizer are then
                                                      one launch and left empty, for our graph runs too)
  phase_clocks                                        how each side's phases were timed: ours with host clocks (on
                                                      a GPU: launch time, the device's wait falling in the
                                                      optimizer); the reference peers' with CUDA events on a GPU
  other_cores_median, other_cores_max                 cores other processes kept busy during the runs
  rust_workers, pytorch_loader, model_flags, omp_wait_policy, generated_data, torch_version, note
"""
import argparse, csv, io, json, os, statistics, sys, time

from gpucheck import output  # bench/ is this script's folder, first on the path

ENTRIES = {  # entry: (exercise, model, unit)
    "cnn": ("exercise1", "cnn", "images/s"),
    "resnet34": ("exercise1", "resnet34", "images/s"),
    "vgg19": ("exercise1", "vgg19", "images/s"),
    "nlp": ("exercise1_nlp", "transformer", "tokens/s"),
}
# Peer (PEERS' name): its CSV column stem. The eager default peer keeps the columns it always had.
PEERS = {"eager": "pytorch", "fused": "pytorch_fused", "channels-last": "pytorch_channels_last",
         "channels-last-fused": "pytorch_channels_last_fused", "compile": "pytorch_compile",
         "reduce-overhead": "pytorch_reduce_overhead", "cuda-graph": "pytorch_cuda_graph", "lightning": "lightning"}
GRAPH_PEERS = {"reduce-overhead", "cuda-graph"}
RUST_MODES = {"rust": "eager", "rust-graph": "cuda-graph"}


def peer_columns(name):
    stem = PEERS[name]
    ratio = "ratio_rounds_median" if name == "eager" else f"ratio_{stem.removeprefix('pytorch_')}"
    return [f"{stem}_throughput", f"{stem}_min", f"{stem}_max"] + (["ratio"] if name == "eager" else []) + [ratio]


COLUMNS = (["finished_at", "exercise", "model", "device", "gpu", "precision", "rust_layout", "rust_mode", "threads", "steps",
            "rounds", "unit", "throughput_measure", "rust_throughput", "rust_min", "rust_max", "fastest_peer",
            "fastest_peer_throughput", "fastest_peer_min", "fastest_peer_max", "ratio_fastest"]
           + [c for name in PEERS for c in peer_columns(name)]
           + ["peers", "peers_failed", "params_rust", "params_pytorch", "rust_data_ms", "rust_fwd_bwd_ms", "rust_optim_ms",
              "pytorch_data_ms", "pytorch_fwd_bwd_ms", "pytorch_optim_ms", "fastest_peer_data_ms", "fastest_peer_fwd_bwd_ms",
              "fastest_peer_optim_ms", "fastest_peer_replay_ms", "phase_clocks", "other_cores_median", "other_cores_max",
              "rust_workers", "pytorch_loader", "model_flags", "omp_wait_policy", "generated_data", "torch_version", "note"])


# ---- record: one run's line --------------------------------------------------------------

def rust_record(path, graph):
    r = json.load(open(path))
    steps = max(r["steps"], 1)
    # Our --cuda-graph replays are not split into phases, and the results JSON has no replay
    # time: its forward+backward and optimizer times are the warm-up steps' only.
    split = not graph
    return {"throughput": r.get("steady_throughput") or r["throughput"], "steady": r.get("steady_throughput") is not None,
            "examples_per_step": r["throughput"] * r["train_time_s"] / steps, "steps": r["steps"], "params": r["params"],
            "train_time_s": r["train_time_s"], "data_wait_s": r["data_wait_s"],
            "forward_backward_s": r["forward_backward_s"] if split else None,
            # The reference peers time clipping with the optimizer; our JSON keeps it apart.
            "optimizer_s": r["optimizer_s"] + (r.get("allreduce_time_s") or 0.0) if split else None,
            "graph_replay_s": None, "phase_clock": "host", "generated": r.get("data_generated"),
            "torch_version": r.get("torch_version")}


def peer_record(path):
    lines = open(path).read().splitlines()
    if not lines:
        raise SystemExit(f"error: {path}: the peer printed nothing")
    r = json.loads(lines[-1])
    replayed = bool(r.get("graph_replay_s"))
    return {"throughput": r.get("steady_throughput") or r["examples_per_step"] * r["steps"] / (r.get("train_time_s") or r["seconds"]),
            "steady": r.get("steady_throughput") is not None, "examples_per_step": r["examples_per_step"], "steps": r["steps"],
            "params": r.get("params"), "train_time_s": r.get("train_time_s"), "data_wait_s": r.get("data_wait_s"),
            # A captured step's forward+backward and optimizer times are its warm-up steps' only.
            "forward_backward_s": None if replayed else r.get("forward_backward_s"),
            "optimizer_s": None if replayed else r.get("optimizer_s"), "graph_replay_s": r.get("graph_replay_s") if replayed else None,
            "phase_clock": r.get("phase_clock"), "gpu": r.get("gpu"), "generated": r.get("generated_data"),
            "torch_version": r.get("torch_version"), "loader": r.get("loader"), "layouts": r.get("layouts"),
            "optimizer_impl": r.get("optimizer_impl"), "last_loss": r.get("last_loss")}


def record(a):
    base = {"entry": a.entry, "impl": a.side, "round": a.round, "others": a.others}
    if a.failed is not None:
        line = dict(base, failed=True, error=a.failed)
    elif a.rust_json:
        line = dict(base, **rust_record(a.rust_json, a.side == "rust-graph"))
    else:
        line = dict(base, **peer_record(a.peer_stdout))
    output.append(a.runs, json.dumps(line) + "\n")
    if a.failed is None:
        print(f"{line['throughput']:.1f}")  # for bench.sh's progress line


# ---- table: the rows ---------------------------------------------------------------------

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(x, spec):
    return "" if x is None else format(x, spec)


def per_step_ms(runs, key):
    m = median([r[key] / r["steps"] if r.get(key) is not None else None for r in runs])
    return None if m is None else 1000 * m


def paired_ratio(ours, theirs):
    """Median over the rounds of ours / theirs in the same round."""
    by_round = {r["round"]: r["throughput"] for r in theirs}
    return median([r["throughput"] / by_round[r["round"]] for r in ours if r["round"] in by_round])


def rows_for(entry, runs, a):
    exercise, model, unit = ENTRIES[entry]
    mine = [r for r in runs if r["entry"] == entry]
    failed = sorted({r["impl"] for r in mine if r.get("failed")})
    timed = [r for r in mine if r["round"] > 0 and not r.get("failed")]
    by_side = {}
    for r in timed:
        by_side.setdefault(r["impl"], []).append(r)
    if "rust" not in by_side:
        return []
    rounds = {r["round"] for r in by_side["rust"]}
    # A peer that failed in any round is left out of the entry: the fastest is among complete peers.
    complete = {name: rs for name, rs in by_side.items()
                if name in PEERS and name not in failed and {r["round"] for r in rs} >= rounds}
    if "eager" not in complete:
        return []
    rows = []
    for side, mode in RUST_MODES.items():
        ours = by_side.get(side)
        if not ours:
            continue
        kind = {name: rs for name, rs in complete.items() if (name in GRAPH_PEERS) == (mode == "cuda-graph")}
        fastest = max(kind, key=lambda name: median([r["throughput"] for r in kind[name]]), default=None)
        eager = complete["eager"]
        rt, pt = median([r["throughput"] for r in ours]), median([r["throughput"] for r in eager])
        row = {
            "finished_at": int(time.time()), "exercise": exercise, "model": model, "device": a.device,
            "gpu": next((r["gpu"] for rs in complete.values() for r in rs if r.get("gpu")), ""), "precision": a.precision,
            "rust_layout": a.rust_layout if exercise == "exercise1" else "", "rust_mode": mode,
            "threads": a.threads, "steps": ours[0]["steps"], "rounds": len(ours), "unit": unit,
            "throughput_measure": f"steady state after {a.steady_after} steps"
                                  if all(r.get("steady") for rs in [ours, *complete.values()] for r in rs) else "whole run",
            "rust_throughput": fmt(rt, ".2f"), "rust_min": fmt(min(r["throughput"] for r in ours), ".2f"),
            "rust_max": fmt(max(r["throughput"] for r in ours), ".2f"),
            "ratio": fmt(rt / pt, ".4f"),
            "peers": " ".join(name for name in PEERS if name in complete), "peers_failed": " ".join(failed),
            "params_rust": ours[0]["params"], "params_pytorch": eager[0]["params"],
            "rust_data_ms": fmt(per_step_ms(ours, "data_wait_s"), ".2f"),
            "rust_fwd_bwd_ms": fmt(per_step_ms(ours, "forward_backward_s"), ".2f"),
            "rust_optim_ms": fmt(per_step_ms(ours, "optimizer_s"), ".2f"),
            "pytorch_data_ms": fmt(per_step_ms(eager, "data_wait_s"), ".2f"),
            "pytorch_fwd_bwd_ms": fmt(per_step_ms(eager, "forward_backward_s"), ".2f"),
            "pytorch_optim_ms": fmt(per_step_ms(eager, "optimizer_s"), ".2f"),
            "phase_clocks": "rust host; peers " + ("cuda events" if any(r.get("phase_clock") == "cuda events" for r in eager) else "host"),
            "other_cores_median": fmt(median([r.get("others") for rs in [ours, *complete.values()] for r in rs]), ".2f"),
            "other_cores_max": fmt(max((r["others"] for rs in [ours, *complete.values()] for r in rs if r.get("others") is not None),
                                       default=None), ".2f"),
            "rust_workers": a.workers if exercise == "exercise1" else "",
            "pytorch_loader": eager[0].get("loader") or "",
            "model_flags": a.nlp_model_flags if entry == "nlp" else "",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "generated_data": "yes" if any(r.get("generated") for rs in [ours, *complete.values()] for r in rs) else "no",
            "torch_version": ours[0].get("torch_version") or eager[0].get("torch_version") or "",
            "note": a.note,
        }
        for name, rs in complete.items():
            throughput, low, high, *ratios = peer_columns(name)
            values = [r["throughput"] for r in rs]
            row.update({throughput: fmt(median(values), ".2f"), low: fmt(min(values), ".2f"), high: fmt(max(values), ".2f"),
                        ratios[-1]: fmt(paired_ratio(ours, rs), ".4f")})
        if fastest:
            rs = kind[fastest]
            values = [r["throughput"] for r in rs]
            row.update({"fastest_peer": fastest, "fastest_peer_throughput": fmt(median(values), ".2f"),
                        "fastest_peer_min": fmt(min(values), ".2f"), "fastest_peer_max": fmt(max(values), ".2f"),
                        "ratio_fastest": fmt(paired_ratio(ours, rs), ".4f"),
                        "fastest_peer_data_ms": fmt(per_step_ms(rs, "data_wait_s"), ".2f"),
                        "fastest_peer_fwd_bwd_ms": fmt(per_step_ms(rs, "forward_backward_s"), ".2f"),
                        "fastest_peer_optim_ms": fmt(per_step_ms(rs, "optimizer_s"), ".2f"),
                        "fastest_peer_replay_ms": fmt(per_step_ms(rs, "graph_replay_s"), ".2f")})
        else:
            print(f"WARNING: {exercise} {model}: no {mode} peer completed every round: no fastest peer to compare our {mode} run with")
        for name, rs in complete.items():
            if rs[0]["steps"] != ours[0]["steps"]:
                print(f"WARNING: {exercise} {model}: the {name} peer trained {rs[0]['steps']} steps, ours {ours[0]['steps']}")
            if rs[0].get("params") is not None and rs[0]["params"] != ours[0]["params"]:
                print(f"WARNING: {exercise} {model}: Rust has {ours[0]['params']} parameters, the {name} peer "
                      f"{rs[0]['params']}: not the same model")
        rows.append(row)
    return rows


def print_table(rows, a):
    generated = any(r["generated_data"] == "yes" for r in rows)
    omp = os.environ.get("OMP_WAIT_POLICY")
    gpu = next((r["gpu"] for r in rows if r["gpu"]), "")
    print(f"\nTraining throughput, Rust (tch) vs its PyTorch peers: {gpu or a.device}, precision {a.precision}, "
          f"{a.threads} threads, {a.rounds} rounds (order rotated), medians (min-max), {rows[0]['throughput_measure']}"
          f"{f'; OMP_WAIT_POLICY={omp}' if omp else ''}{'; GENERATED data' if generated else ''}")
    print("| exercise | model | ours | steps | unit | Rust | fastest peer | its figure | Rust/fastest (per-round median) | "
          "PyTorch eager (Rust/it) | other peers (Rust/it) | Rust data / fwd+bwd / optim (ms/step) | fastest peer's (ms/step) |")
    print("|---|---|---|---:|---|---:|---|---:|---:|---:|---|---|---|")
    spread = lambda r, stem: f"{float(r[stem + '_throughput']):.1f} ({float(r[stem + '_min']):.1f}-{float(r[stem + '_max']):.1f})"
    for r in rows:
        split = lambda side: " / ".join(r[f"{side}_{k}_ms"] or "-" for k in ("data", "fwd_bwd", "optim"))
        others = ", ".join(f"{name} {float(r[peer_columns(name)[0]]):.1f} ({float(r[peer_columns(name)[-1]]):.3f})"
                           for name in PEERS if name != "eager" and r.get(peer_columns(name)[0]))
        if r["peers_failed"]:
            others += f"; failed: {r['peers_failed']}"
        if r["fastest_peer"]:
            replay = f" / replay {r['fastest_peer_replay_ms']}" if r["fastest_peer_replay_ms"] else ""
            fastest = [r["fastest_peer"], spread(r, "fastest_peer"), f"{float(r['ratio_fastest']):.3f}", split("fastest_peer") + replay]
        else:
            fastest = ["-", "-", "-", "-"]
        cells = [r["exercise"], r["model"], r["rust_mode"], r["steps"], r["unit"], spread(r, "rust"), *fastest[:3],
                 f"{float(r['pytorch_throughput']):.1f} ({float(r['ratio_rounds_median']):.3f})", others or "-", split("rust"), fastest[3]]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"(phases: {rows[0]['phase_clocks']})")


def table(a):
    with open(a.runs) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    rows = [row for entry in ENTRIES for row in rows_for(entry, runs, a)]
    if not rows:
        raise SystemExit("error: no entry with both our run and the eager peer's in every round")
    print_table(rows, a)

    busy = [r for r in rows if r["other_cores_max"] and float(r["other_cores_max"]) >= 0.25]
    if busy:
        print("WARNING: other processes kept the CPUs busy during some runs (up to "
              f"{max(float(r['other_cores_max']) for r in busy):.2f} cores, column other_cores_max): the "
              "comparison is unreliable; rerun on an idle machine, or with OMP_WAIT_POLICY=passive on both sides")

    os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
    old_rows, rewrite = [], False
    if os.path.exists(a.csv) and os.path.getsize(a.csv) > 0:
        with open(a.csv, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != COLUMNS:  # written by an older bench: rewrite under today's header
                old_rows, rewrite = list(reader), True
    new = rewrite or not os.path.exists(a.csv) or os.path.getsize(a.csv) == 0
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=COLUMNS, restval="", extrasaction="ignore")
    if new:
        w.writeheader()
    w.writerows(old_rows + rows)
    # Rewritten whole (old rows under today's header) or appended to, never through a link.
    (output.write if rewrite else output.append)(a.csv, text.getvalue())
    print(f"appended {len(rows)} row(s) to {a.csv}")

    nlp = [r for r in rows if r["exercise"] == "exercise1_nlp" and r["rust_mode"] == "eager"]
    if a.nlp_csv and nlp:
        r = nlp[0]
        new = not os.path.exists(a.nlp_csv)
        text = io.StringIO(newline="")
        w = csv.writer(text)
        if new:
            w.writerow(["finished_at", "device", "threads", "steps", "rounds", "model_flags", "generated_data",
                        "rust_tokens_per_s", "pytorch_tokens_per_s", "ratio"])
        w.writerow([r["finished_at"], r["device"], r["threads"], r["steps"], r["rounds"], r["model_flags"],
                    r["generated_data"], r["rust_throughput"], r["pytorch_throughput"], r["ratio"]])
        output.append(a.nlp_csv, text.getvalue())
        print(f"appended to {a.nlp_csv}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="append one run's line to --runs")
    r.add_argument("--runs", required=True)
    r.add_argument("--entry", required=True, choices=list(ENTRIES))
    r.add_argument("--side", required=True, choices=list(RUST_MODES) + list(PEERS))
    r.add_argument("--round", required=True, type=int)
    r.add_argument("--others", type=float, default=None, help="cores other processes kept busy during the run")
    source = r.add_mutually_exclusive_group(required=True)
    source.add_argument("--rust-json", help="our binary's results JSON")
    source.add_argument("--peer-stdout", help="a peer's standard output (its JSON is the last line)")
    source.add_argument("--failed", metavar="ERROR", help="the run failed: its last stderr line")
    t = sub.add_parser("table", help="print the table and append the CSV rows")
    t.add_argument("--runs", required=True)
    t.add_argument("--csv", required=True)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", default="")
    t.add_argument("--rounds", default="")
    t.add_argument("--workers", default="2")
    t.add_argument("--nlp-model-flags", default="")
    t.add_argument("--precision", default="32")
    t.add_argument("--steady-after", default="")
    t.add_argument("--rust-layout", default="nchw", help="the Rust image runs' memory format (nchw or channels-last)")
    t.add_argument("--note", default="", help="free text for the CSV's note column (BENCH_NOTE)")
    t.add_argument("--nlp-csv", default=None, help="also append the nlp entry to this CSV in bench/nlp.sh's old format")
    a = p.parse_args()
    if a.command == "record" and a.side in RUST_MODES and a.peer_stdout or a.command == "record" and a.side in PEERS and a.rust_json:
        p.error(f"--side {a.side}: {'--rust-json' if a.side in RUST_MODES else '--peer-stdout'} is its source")
    try:
        if a.command == "record":
            record(a)
        else:
            table(a)
    except output.Refused as e:
        # A link, a FIFO or a folder at a file it names: one line, as for its other arguments.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
