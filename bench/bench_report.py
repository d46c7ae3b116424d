#!/usr/bin/env python3
"""The table and CSV rows of `make bench` (bench/bench.sh) from its runs, one JSON line each:
{"entry", "impl": "rust"|"pytorch"|"pytorch-channels-last"|"pytorch-compile", "round" (0: the
untimed warm-up, left out), "throughput" (steady state), "steps", "params", "train_time_s",
"data_wait_s", "forward_backward_s", "optimizer_s", ...}. Medians over the rounds."""
import argparse, csv, json, os, statistics, time

ENTRIES = {  # entry: (exercise, model, unit)
    "cnn": ("exercise1", "cnn", "images/s"),
    "resnet34": ("exercise1", "resnet34", "images/s"),
    "vgg19": ("exercise1", "vgg19", "images/s"),
    "nlp": ("exercise1_nlp", "transformer", "tokens/s"),
}
PEERS = {"pytorch-channels-last": "channels_last", "pytorch-compile": "compile"}
COLUMNS = ["finished_at", "exercise", "model", "device", "gpu", "precision", "rust_layout", "threads", "steps", "rounds", "unit",
           "throughput_measure", "rust_throughput", "pytorch_throughput", "ratio", "ratio_rounds_median",
           "pytorch_channels_last_throughput", "ratio_channels_last", "pytorch_compile_throughput", "ratio_compile", "params_rust", "params_pytorch",
           "rust_data_ms", "rust_fwd_bwd_ms", "rust_optim_ms", "pytorch_data_ms", "pytorch_fwd_bwd_ms",
           "pytorch_optim_ms", "other_cores_median", "other_cores_max", "rust_workers", "pytorch_loader", "model_flags",
           "omp_wait_policy", "generated_data",
           "torch_version", "note"]


def median(runs, key, per_step=False):
    values = [r[key] / (r["steps"] if per_step else 1) for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(x, spec):
    return "" if x is None else format(x, spec)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True)
    p.add_argument("--csv", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", default="")
    p.add_argument("--rounds", default="")
    p.add_argument("--loader", default="memory")
    p.add_argument("--workers", default="2")
    p.add_argument("--nlp-model-flags", default="")
    p.add_argument("--precision", default="32")
    p.add_argument("--steady-after", default="")
    p.add_argument("--rust-layout", default="nchw", help="the Rust image runs' memory format (nchw or channels-last)")
    p.add_argument("--note", default="", help="free text for the CSV's note column (BENCH_NOTE)")
    p.add_argument("--nlp-csv", default=None, help="also append the nlp entry to this CSV in bench/nlp.sh's old format")
    a = p.parse_args()
    with open(a.runs) as f:
        runs = [r for r in (json.loads(line) for line in f if line.strip()) if r["round"] > 0]
    rows = []
    for entry, (exercise, model, unit) in ENTRIES.items():
        rust = [r for r in runs if r["entry"] == entry and r["impl"] == "rust"]
        torch_ = [r for r in runs if r["entry"] == entry and r["impl"] == "pytorch"]
        if not rust or not torch_:
            continue
        rt, pt = median(rust, "throughput"), median(torch_, "throughput")
        # Each round's pair ran back to back: the median of the per-round ratios is less
        # sensitive to the machine's state drifting between rounds than the ratio of medians.
        by_round = {r["round"]: r["throughput"] for r in torch_}
        paired = statistics.median(r["throughput"] / by_round[r["round"]] for r in rust if r["round"] in by_round)
        ms = lambda runs, key: None if median(runs, key, True) is None else 1000 * median(runs, key, True)
        generated = any(r.get("generated") for r in rust + torch_)
        steady = all(r.get("steady") for r in rust + torch_)
        peers = {}
        for impl, name in PEERS.items():
            runs_ = [r for r in runs if r["entry"] == entry and r["impl"] == impl]
            if runs_:
                peer = median(runs_, "throughput")
                peers[f"pytorch_{name}_throughput"] = f"{peer:.2f}"
                peers[f"ratio_{name}"] = f"{rt / peer:.4f}"
        rows.append({
            "finished_at": int(time.time()), "exercise": exercise, "model": model, "device": a.device,
            "gpu": next((r["gpu"] for r in torch_ if r.get("gpu")), ""), "precision": a.precision,
            "rust_layout": a.rust_layout if exercise == "exercise1" else "",
            "threads": a.threads, "steps": rust[0]["steps"], "rounds": len(rust), "unit": unit,
            "throughput_measure": f"steady state after {a.steady_after} steps" if steady else "whole run",
            **peers,
            "rust_throughput": f"{rt:.2f}", "pytorch_throughput": f"{pt:.2f}", "ratio": f"{rt / pt:.4f}", "ratio_rounds_median": f"{paired:.4f}",
            "params_rust": rust[0]["params"], "params_pytorch": torch_[0]["params"],
            "rust_data_ms": fmt(ms(rust, "data_wait_s"), ".2f"), "rust_fwd_bwd_ms": fmt(ms(rust, "forward_backward_s"), ".2f"),
            "rust_optim_ms": fmt(ms(rust, "optimizer_s"), ".2f"), "pytorch_data_ms": fmt(ms(torch_, "data_wait_s"), ".2f"),
            "pytorch_fwd_bwd_ms": fmt(ms(torch_, "forward_backward_s"), ".2f"),
            "pytorch_optim_ms": fmt(ms(torch_, "optimizer_s"), ".2f"),
            "other_cores_median": fmt(median(rust + torch_, "others"), ".2f"),
            "other_cores_max": fmt(max((r["others"] for r in rust + torch_ if r.get("others") is not None), default=None), ".2f"),
            "rust_workers": a.workers if exercise == "exercise1" else "",
            "pytorch_loader": torch_[0].get("loader") or "",
            "model_flags": a.nlp_model_flags if entry == "nlp" else "",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "generated_data": "yes" if generated else "no",
            "torch_version": rust[0].get("torch_version") or torch_[0].get("torch_version") or "",
            "note": a.note,
        })
        if rust[0]["params"] != torch_[0]["params"]:
            print(f"WARNING: {exercise} {model}: Rust has {rust[0]['params']} parameters, PyTorch "
                  f"{torch_[0]['params']}: not the same model")
    if not rows:
        raise SystemExit("error: no complete pairs of runs")

    generated = any(r["generated_data"] == "yes" for r in rows)
    omp = os.environ.get("OMP_WAIT_POLICY")
    gpu = next((r["gpu"] for r in rows if r["gpu"]), "")
    print(f"\nTraining throughput, Rust (tch) vs PyTorch eager: {gpu or a.device}, precision {a.precision}, "
          f"{a.threads} threads, {a.rounds} rounds A B A B, medians, {rows[0]['throughput_measure']}"
          f"{f'; OMP_WAIT_POLICY={omp}' if omp else ''}{'; GENERATED data' if generated else ''}")
    print("| exercise | model | steps | unit | Rust | PyTorch | Rust/PyTorch | per-round ratios, median | "
          "PyTorch channels-last (ratio) | torch.compile (ratio) | Rust data / fwd+bwd / optim (ms/step) | PyTorch data / fwd+bwd / optim (ms/step) |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        split = lambda side: " / ".join(r[f"{side}_{k}_ms"] or "–" for k in ("data", "fwd_bwd", "optim"))
        peer = lambda name: (f"{float(r[f'pytorch_{name}_throughput']):.1f} ({float(r[f'ratio_{name}']):.3f})"
                             if r.get(f"pytorch_{name}_throughput") else "–")
        print(f"| {r['exercise']} | {r['model']} | {r['steps']} | {r['unit']} | {float(r['rust_throughput']):.1f} | "
              f"{float(r['pytorch_throughput']):.1f} | {float(r['ratio']):.3f} | {float(r['ratio_rounds_median']):.3f} | "
              f"{peer('channels_last')} | {peer('compile')} | {split('rust')} | {split('pytorch')} |")

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
    with open(a.csv, "w" if rewrite else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(old_rows + rows)
    print(f"appended {len(rows)} row(s) to {a.csv}")

    nlp = [r for r in rows if r["exercise"] == "exercise1_nlp"]
    if a.nlp_csv and nlp:
        r = nlp[0]
        new = not os.path.exists(a.nlp_csv)
        with open(a.nlp_csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["finished_at", "device", "threads", "steps", "rounds", "model_flags", "generated_data",
                            "rust_tokens_per_s", "pytorch_tokens_per_s", "ratio"])
            w.writerow([r["finished_at"], r["device"], r["threads"], r["steps"], r["rounds"], r["model_flags"],
                        r["generated_data"], r["rust_throughput"], r["pytorch_throughput"], r["ratio"]])
        print(f"appended to {a.nlp_csv}")


if __name__ == "__main__":
    main()
