#!/usr/bin/env python3
"""`make gpu-check` / the GPU bundle's `run.sh`: every GPU path of the workspace on this machine's
GPU(s), in tiers that each fit a short allocation, read in one go: a table of tier, path, verdict,
figure, ratio to the fastest PyTorch peer, wall time and the run each row came from, in
<results>/gpu-check.md and gpu-check.json, rewritten after every check, and an exit status (1 if
a check failed).

The tiers (bench/gpucheck/tiers.py; `--tiers` lists them with their expected time): first the
verdicts (the multi-rank paths against one rank, every exercise learning, the speed features
equal to the plain path), then the side-by-side timings against every PyTorch peer, then the
machine's figures (memory, the profiler, the 1.4B model's MFU, the planner's profile and plan).
Each is sized to 6 minutes on an H200 by its rows' recorded times, so a 15-minute allocation holds
a tier, the machine's start and a rerun.

A check is started only when its estimate (the wall time a table measured for it, else a default)
fits in what is left of the budget (--budget SECONDS, default 480); the rest get the row "not run
(budget)". `--resume-from TABLE` carries over what passed and runs only what was skipped, cut
short or failed. A run killed part-way leaves the table of what it finished, the others marked
"not run (not reached)". Every row records its own GPU, commit, time and wall time; a merged or
resumed table keeps each row's.

  .gpu-bundle/run.sh --next --out results               # on a node: the first tier the committed table lacks
  .gpu-bundle/run.sh --tier 1 --budget 360 --out results
  bench/gpu_check.py --resume-from results/gpu-check.json --tier 1    # only what was not done
  bench/gpu_check.py --merge results/gpu-check.json new/gpu-check.json --out results   # a tier into the committed table
  bench/gpu_check.py --table results/gpu-check.json     # the table of a recorded check
  bench/gpu_check.py --tiers                            # the tiers and their expected time

Without a CUDA GPU it says so in one line and exits 2. `--device cpu` runs the checks that do not
need CUDA on the CPU instead, at tiny sizes (the multi-rank rows over MPI): how the harness itself
is tested.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpucheck import course, docs, features, learning, machine, multirank, output, table, tiers, timings  # noqa: E402
from gpucheck.harness import ROOT, Harness, kill_group  # noqa: E402

DEFAULT_BUDGET = 480
BINARIES = ("exercise1", "exercise1_nlp", "exercise2", "exercise3", "prepare_data", "why_gpus")


def detect_gpus(python):
    """(count, name of GPU 0) as the machine's PyTorch sees them."""
    code = "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(n); print(torch.cuda.get_device_name(0) if n else '')"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"({python} could not ask: {e})"
    lines = out.stdout.splitlines()
    if out.returncode != 0 or not lines:
        return 0, f"({python} cannot import torch)"
    return int(lines[0]), lines[1] if len(lines) > 1 else ""


def git_commit():
    """The commit the binaries were built from: the bundle's COMMIT file, else the checkout's."""
    stamp = os.path.join(ROOT, "COMMIT")
    if os.path.exists(stamp):
        with open(stamp) as f:
            return f.read().strip() or "?"
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def committed_table(path):
    """The committed table --next reads and estimates come from: --committed, the bundle's copy,
    or the checkout's results/gpu-check.json; None where there is none."""
    for candidate in [path] if path else [os.path.join(ROOT, "committed-gpu-check.json"), os.path.join(ROOT, "results", "gpu-check.json")]:
        if candidate and os.path.exists(candidate):
            return table.read(candidate, "the committed table")
    if path:
        print(f"gpu-check: no committed table at {path}", file=sys.stderr)
        sys.exit(2)
    return None


def plan_all(h):
    """Every check of every tier, in tier order (within a tier, as the modules plan them)."""
    for module in (multirank, learning, features, timings, machine, course):
        h.planning = module.__name__.rsplit(".", 1)[-1]
        module.plan(h)
    h.planning = None
    h.plan.sort(key=lambda p: p.tier)


def tier_arg(text):
    try:
        return tiers.tier_number(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("BIN", os.path.join(ROOT, "target", "release")), help="where the binaries are (BIN)")
    p.add_argument("--python", default=os.environ.get("TORCH_PYTHON", sys.executable), help="a Python with PyTorch 2.11 (TORCH_PYTHON)")
    p.add_argument("--results", "--out", default=os.path.join(ROOT, "results"), help="where gpu-check.json and gpu-check.md go")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help=f"seconds for the whole run, data included (default {DEFAULT_BUDGET})")
    p.add_argument("--tier", type=tier_arg, action="append", help="run only this tier, by number or name (course; repeatable; --tiers lists them)")
    p.add_argument("--next", action="store_true", help="run the first tier the committed table has no rows for")
    p.add_argument("--tiers", action="store_true", help="list the tiers with their expected time here and whether the committed table has them, and exit")
    p.add_argument("--committed", metavar="TABLE", help="the committed table for --next and the estimates (default: the bundle's, else results/gpu-check.json)")
    p.add_argument("--resume-from", metavar="TABLE", help="a recorded check: keep what passed, run only what was skipped, cut short or failed")
    p.add_argument("--plan-from", metavar="TABLE", help="a recorded check whose wall times plan this run's budget (it runs every check)")
    p.add_argument("--table", metavar="JSON", help="print the table of a recorded check and exit with its verdict")
    p.add_argument("--merge", metavar="TABLE", nargs="+", help="merge recorded checks (earliest first) into --out's gpu-check.json/.md, each row keeping its provenance")
    p.add_argument("--docs", action="store_true", help="rewrite the GPU figures' blocks in README and docs/ from the committed table, and exit")
    p.add_argument("--check", action="store_true", help="with --docs: change nothing, exit 1 naming each block that is not what the table gives")
    p.add_argument("--only", action="append", help="run only the checks whose path contains this (repeatable)")
    p.add_argument("--no-timings", action="store_true", help="skip the side-by-side timings against PyTorch")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the harness's own test, the checks that need no CUDA, tiny")
    p.add_argument("--keep", action="store_true", help="keep the runs' folder (logs, results)")
    return p, p.parse_args()


def main():
    parser, args = parse()
    if args.table:
        recorded = table.read(args.table, "--table")
        print(table.render(recorded["checks"], table.header_of(recorded)), end="")
        return table.verdict_exit(recorded["checks"])
    if args.merge:
        merged = table.merge([table.read(path, "--merge") for path in args.merge])
        os.makedirs(args.results, exist_ok=True)
        stem = "gpu-check" if merged.get("device") != "cpu" else "gpu-check-cpu"
        table.write(os.path.join(args.results, f"{stem}.json"), merged)
        print(f"merged {len(args.merge)} tables ({len(merged['checks'])} rows) into {os.path.join(args.results, stem + '.json')}")
        return 0
    if args.check and not args.docs:
        print("gpu-check: --check goes with --docs", file=sys.stderr)
        return 2
    if args.docs:
        committed = committed_table(args.committed)
        if committed is None:
            print("gpu-check: --docs needs the committed table (results/gpu-check.json)", file=sys.stderr)
            return 2
        # The checks a GPU's tiers plan (what the pages say has or has not run).
        h = Harness(args, "cuda", 1, committed.get("gpu"), git_commit(), None, committed)
        plan_all(h)
        problems = docs.update(ROOT, committed, h.plan, args.check)
        for line in problems:
            print(f"gpu-check --docs: {line}", file=sys.stderr)
        if not args.check:
            print(f"gpu-check --docs: the blocks of {', '.join(docs.PAGES)} written from the committed table")
        return 1 if problems else 0
    if not args.budget > 0:
        print(f"gpu-check: --budget must be a positive number of seconds, got {args.budget:g}", file=sys.stderr)
        return 2
    if args.next and args.tier:
        print("gpu-check: --next picks the tier itself: give --next or --tier, not both", file=sys.stderr)
        return 2
    if args.tier and any(t not in tiers.NAMES for t in args.tier):
        print(f"gpu-check: --tier {', '.join(map(str, args.tier))}: the tiers are {min(tiers.NAMES)} to {max(tiers.NAMES)} (--tiers lists them)", file=sys.stderr)
        return 2
    earlier = table.read(args.resume_from, "--resume-from") if args.resume_from else None
    plan_from = table.read(args.plan_from, "--plan-from") if args.plan_from else None
    committed = committed_table(args.committed)

    gpus, name = detect_gpus(args.python)
    if args.device == "cuda" and gpus == 0 and not args.tiers:
        why = f"{args.python}: " + (name if name.startswith("(") else "torch.cuda.is_available() is False")
        print(f"gpu-check: no CUDA GPU on this machine ({why}); run it on a GPU node", file=sys.stderr)
        return 2
    missing = [b for b in BINARIES if not os.access(os.path.join(args.bin, b), os.X_OK)]
    if missing and not args.tiers:
        print(f"gpu-check: no {', '.join(missing)} in {args.bin}: build them (make build) or point BIN at the prebuilt binaries", file=sys.stderr)
        return 2
    # The committed table's wall times plan the budget where no closer table is given.
    h = Harness(args, args.device, gpus if gpus or args.device == "cpu" else 1, name, git_commit(), earlier, plan_from or committed)
    plan_all(h)
    if args.tiers:
        print(tiers.listing(committed, h))
        return 0
    chosen = args.tier
    if args.next:
        tier = tiers.next_tier(committed, h)
        if tier is None:
            print("gpu-check: the committed table has every tier; --tier N runs one again")
            return 0
        chosen = [tier]
    h.select(set(chosen) if chosen else None, args.only)
    for t in sorted({p.tier for p in h.selected}):
        count = sum(1 for p in h.selected if p.tier == t)
        print(f"tier {t}: {tiers.NAMES[t]}: {count} check(s), expected about {tiers.expected(h, t):.0f} s", flush=True)
    try:
        os.makedirs(args.results, exist_ok=True)
    except OSError as e:
        print(f"gpu-check: cannot write the results folder {args.results}: {e}", file=sys.stderr)
        return 2

    stem = "gpu-check" if args.device == "cuda" else "gpu-check-cpu"
    json_path = os.path.join(args.results, f"{stem}.json")
    # Said before the data and the first check, with the words the write itself would use.
    output.check_file(json_path[:-len(".json")] + ".md")
    output.check_file(json_path)

    def record(rows):
        recorded = {
            "finished_at": int(time.time()), "seconds": round(time.time() - h.started), "budget": args.budget, "device": args.device, "gpu": name,
            "gpus": gpus, "tier": chosen[0] if chosen and len(chosen) == 1 else None, "torch_python": args.python, "binaries": args.bin, "commit": h.commit,
            "data_seconds": getattr(h, "data_seconds", None),
            "resumed_from": None if earlier is None else {"path": args.resume_from, "commit": earlier.get("commit"), "finished_at": earlier.get("finished_at")},
            "complete": all(table.ran(r["verdict"]) for r in rows), "checks": rows,
        }
        table.write(json_path, recorded)
        return recorded

    def stop(signum, _frame):
        # A signal (the allocation's end, Ctrl-C): end the run in progress and leave the table
        # with the check in progress marked, so that --resume-from goes on from there.
        for child in h.children:
            kill_group(child)
        try:
            record(h.interrupted())
        except output.Refused as e:
            print(f"gpu-check: {e}", file=sys.stderr)
        print(f"\ngpu-check: stopped by signal {signum}; the table so far is in {json_path[:-5]}.md (--resume-from {json_path} goes on)", file=sys.stderr)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"gpu-check on {name or 'the CPU'} ({gpus} GPU(s)), binaries in {args.bin}; budget {args.budget:.0f} s; runs in {h.work}", flush=True)
    if earlier is not None:
        print(f"resuming {args.resume_from} (commit {earlier.get('commit', '?')}): what passed there is kept, with its own provenance", flush=True)
    started = time.time()
    h.prepare_data()
    h.data_seconds = round(time.time() - started, 1)
    record(h.pending(0))
    print(f"{len(h.selected)} checks planned (data ready after {time.time() - h.started:.0f} s)", flush=True)
    h.execute(record)
    recorded = record(h.rows)
    print("\n" + table.render(recorded["checks"], table.header_of(recorded)) + f"\nwrote {json_path[:-5]}.md and {json_path}")
    left = [r for r in recorded["checks"] if not table.ran(r["verdict"])]
    if left:
        print(f"{len(left)} check(s) not run for the budget: --resume-from {json_path} runs them (and what failed)")
    if args.keep:
        print(f"the runs' logs and results: {h.work}")
    else:
        shutil.rmtree(h.work, ignore_errors=True)
    return table.verdict_exit(recorded["checks"])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except output.Refused as e:
        # A name the one writer will not write (a link at a folder the run names, a FIFO or a
        # folder at a table's name): one line, as for the other arguments it cannot use.
        print(f"gpu-check: {e}", file=sys.stderr)
        sys.exit(2)
