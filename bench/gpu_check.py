#!/usr/bin/env python3
"""`make gpu-check` / the GPU bundle's `run.sh`: every GPU path of the workspace on this machine's
GPU(s), in one bounded command, read in one go: a table of path, verdict, figure, ratio to PyTorch
and wall time, in <results>/gpu-check.md and gpu-check.json, rewritten after every check, and an
exit status (1 if a check failed).

The checks run in the order a user would miss them most, each within a timeout, inside a budget
(--budget SECONDS, default 480: a 15-minute allocation with the node's start and a rerun in mind):
  1. every exercise runs and learns on CUDA: exercise1's CNN, ResNet34 and VGG19 and exercise1_nlp
     in 32, 16-mixed and bf16-mixed, and 16-true and bf16-true (CNN, ResNet34, exercise1_nlp);
     exercise3's pipeline with both stages on one GPU;
  2. each speed feature against the plain path: --cuda-graph (CNN, exercise1_nlp), channels-last,
     the fused optimizer, --data-on-device, TF32, the pipeline schedules, 16-mixed through the
     gradient scaler, a checkpoint and --resume, ResNet50 fed from JPEG files;
  3. NCCL and ZeRO: exercise2, exercise3 ddp and tp, --zero 1|2|3 (two ranks against one where
     there are two GPUs), the collective watchdog's quiet path (a short --collective-timeout that
     must not fire) and its firing path (one rank's collective made never to complete: the job
     must end naming the operation), a pipeline across processes, a sharded checkpoint written
     and resumed, parameter-server workers on the GPU (the server on the CPU);
  4. --profile's kernels, and each run's peak memory against --estimate-memory (exercise1_nlp,
     the CNN, ResNet34);
  5. timings side by side with PyTorch eager (bench/bench.sh: warm caches, A B A B), with
     torchvision's DataLoader for the JPEG files, and with pytorch-lightning's Trainer for the CNN
     (the course's own tool) where the node has it;
  6. the 1.4B-parameter Transformer's MFU;
  7. the layout planner's profile of this machine (exercise3 profile: the 1.4B model's pieces in
     bf16-mixed at 512 tokens, its optimizer, the collectives among the GPUs), kept as
     <results>/plan-profile.json for planning anywhere.
A check is started only when its estimate (the wall time a table given with --resume-from or
--plan-from measured for it, else a default) fits in what is left of the budget; the rest get the
row "not run (budget)". `--resume-from TABLE` carries over what passed and runs only what was
skipped, cut short or failed. A run killed part-way leaves the table of what it finished, the
others marked "not run (not reached)".

What it checks, beyond "it ran": losses finite and falling; --cuda-graph's losses equal eager's
over the same steps (both --deterministic, to 1e-5), a resumed run's a straight one's, every
pipeline schedule's the others' (to 2e-3), channels-last's the usual layout's at step 1 and the
fused optimizer's the per-parameter one's over 10 steps (to 1e-3: different kernels, whose
roundings training from scratch amplifies); nothing on stderr but our own lines (a LibTorch, CUDA
or NCCL warning fails the row). Throughput against the goals (every exercise at least PyTorch's,
ResNet34 and VGG19 1.1x, --cuda-graph 1.5x, the 1.4B model 50% MFU) is "below goal" rather than a
failure: a slower path still works.

  make gpu-check                                      # builds, gets data, checks
  .gpu-bundle/run.sh --budget 420 --out results       # on a node without Rust (make gpu-bundle)
  bench/gpu_check.py --resume-from results/gpu-check.json   # only what was not done
  bench/gpu_check.py --table results/gpu-check.json   # the table of a recorded check
  bench/gpu_check.py --no-timings --only exercise1    # a subset

Without a CUDA GPU it says so in one line and exits 2. `--device cpu` runs the checks that do
not need CUDA on the CPU instead, at tiny sizes: how the harness itself is tested.
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lines on stderr that are not ours: LibTorch's and c10's log lines (glog style), Kineto's,
# Python warnings, NCCL's warnings, CUDA errors, crashes, Open MPI's complaints. Our own lines are
# plain sentences ("WARNING: ... GENERATED ...", "warning: ...", "note: ...", "error on rank ...").
FOREIGN_STDERR = re.compile(
    r"^\[[WEF]\d{4} |^ERROR:\d{4}-|UserWarning|NCCL WARN|^terminate called|Traceback|panicked at|CUDA error|^\s*\d+: 0x[0-9a-f]+"
    r"|ORTE_ERROR_LOG|^\[[\w.-]+:\d+\] |mca_base_component_repository_open"
)

GOALS = {  # (entry, precision, cuda graph): least ratio to PyTorch eager
    ("cnn", "32", False): 1.0, ("resnet34", "32", False): 1.1, ("vgg19", "32", False): 1.1, ("nlp", "32", False): 1.0,
    ("cnn", "bf16-mixed", False): 1.0, ("resnet34", "bf16-mixed", False): 1.1, ("vgg19", "bf16-mixed", False): 1.1,
    ("nlp", "bf16-mixed", False): 1.0, ("cnn", "32", True): 1.5, ("nlp", "32", True): 1.5,
}
MFU_GOAL = 0.50
DEFAULT_BUDGET = 480

GROUPS = {
    1: "every exercise runs and learns",
    2: "speed features equal the plain path",
    3: "NCCL and ZeRO",
    4: "profile and memory",
    5: "timings against PyTorch",
    6: "the 1.4B model's MFU",
    7: "the layout planner's profile",
}

# Verdicts. Only "fail" fails the command; "not run (...)" rows are what --resume-from runs.
PASS, FAIL, BELOW, SKIPPED = "pass", "fail", "below goal", "skipped"
NOT_RUN_BUDGET, NOT_REACHED, INTERRUPTED = "not run (budget)", "not run (not reached)", "not run (interrupted)"
DONE = (PASS, BELOW)


class CheckFailed(Exception):
    pass


class OutOfTime(Exception):
    """A run of a check passed the check's deadline. `budget`: the budget's end, not the check's
    own limit, came first (the row is "not run (budget)", not a failure)."""

    def __init__(self, seconds, budget):
        super().__init__(f"stopped after {seconds:.0f} s")
        self.seconds, self.budget = seconds, budget


class Planned:
    """A check the run may do: `body()` returns (verdict, figure[, ratio]) for its own row, or a
    list of row dicts (path, verdict, figure, ratio) when one check yields several rows.
    `estimate`: (seconds on a GPU, seconds on the CPU) when no table measured it. `needs`: why it
    cannot run here, or None."""

    def __init__(self, path, body, group, estimate, needs=None, limit=None):
        self.path, self.body, self.group, self.estimate, self.needs, self.limit = path, body, group, estimate, needs, limit


def table(rows, header):
    """The Markdown table of `rows` (dicts), with a closing count line."""
    lines = [header, "", "| path | verdict | figure | ratio to PyTorch | s |", "|---|---|---|---:|---:|"]
    for c in rows:
        ratio = "" if c.get("ratio") is None else f"{c['ratio']:.2f}x"
        figure = c.get("figure", "")
        if c.get("detail") and c["verdict"] != PASS:
            figure = f"{figure}; {c['detail']}" if figure else c["detail"]
        if c.get("earlier"):
            figure = f"{figure} ({c['earlier']})" if figure else f"({c['earlier']})"
        seconds = "" if c.get("seconds") is None else f"{c['seconds']:.0f}"
        lines.append(f"| {c['path']} | {c['verdict']} | {figure.replace('|', '/')} | {ratio} | {seconds} |")
    counts = {}
    for c in rows:
        counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    lines += ["", ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "no checks"]
    return "\n".join(lines) + "\n"


def verdict_exit(rows):
    return 1 if any(c["verdict"] == FAIL for c in rows) else 0


def write_atomically(path, text):
    """`text` to `path` through a temporary file in the same folder and a rename: a reader (or a
    run killed mid-write) sees the old table or the new one, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpu-check-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Harness:
    def __init__(self, args, device, gpus, gpu_name, earlier, plan_from):
        self.args, self.device, self.gpus, self.gpu_name = args, device, gpus, gpu_name
        self.bin = args.bin
        self.python = args.python
        self.work = tempfile.mkdtemp(prefix="gpu-check-")
        self.cpu = device == "cpu"
        self.env = dict(os.environ)
        self.python_env = self.node_env()
        self.runs = {}
        self.plan = []
        self.rows = []
        # Rows of an earlier run (--resume-from) and wall times to plan with (--resume-from or --plan-from).
        self.earlier = earlier
        self.measured = {}
        for recorded in [plan_from, earlier]:
            for row in (recorded or {}).get("checks", []):
                if row.get("seconds") is not None and row["verdict"] not in (NOT_RUN_BUDGET, NOT_REACHED, INTERRUPTED):
                    self.measured[row.get("check", row["path"])] = row["seconds"]
        self.started = time.time()
        self.deadline = self.started + args.budget
        self.check_deadline = None
        self.check_limit_is_budget = False
        self.child = None
        self.current = None
        self.lightning = None

    @staticmethod
    def node_env():
        """The environment for the Python references: the node's own, as it was before the
        bundle's run.sh put its Open MPI and libraries first (the node's mpi4py, which Lightning
        imports, must not load the bundle's libmpi: MPI_Init aborts)."""
        env = dict(os.environ)
        if "COURSE_NODE_PATH" not in env:
            return env  # not started by the bundle (make gpu-check): nothing was added
        env["PATH"] = env.pop("COURSE_NODE_PATH")
        libraries = env.pop("COURSE_NODE_LD_LIBRARY_PATH", "")
        if libraries:
            env["LD_LIBRARY_PATH"] = libraries
        else:
            env.pop("LD_LIBRARY_PATH", None)
        for name in list(env):
            if name in ("OPAL_PREFIX", "PMIX_INSTALL_PREFIX") or name.startswith(("OMPI_MCA_", "PMIX_MCA_")):
                del env[name]
        return env

    # ---- running our binaries ---------------------------------------------------------------
    def spawn(self, command, env=None, cwd=None):
        """Runs `command` in a process group of its own (mpirun and its ranks go together) until it
        ends or the check's deadline passes; returns (code, stdout, stderr, seconds)."""
        started = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or self.env,
                                cwd=cwd or ROOT, start_new_session=True)
        self.child = proc
        try:
            left = None if self.check_deadline is None else max(1.0, self.check_deadline - time.time())
            try:
                out, err = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.communicate()
                raise OutOfTime(time.time() - started, self.check_limit_is_budget)
        finally:
            self.child = None
        return proc.returncode, out, err, time.time() - started

    def run(self, key, binary, args, ok=True, env=None):
        """Runs `binary args` with its own results folder; returns (results JSON or None, stdout,
        stderr, seconds). Kept under `key` for later comparisons."""
        out = os.path.join(self.work, key)
        os.makedirs(out, exist_ok=True)
        command = [os.path.join(self.bin, binary)] + args + ["--quiet", "--results-dir", out]
        code, stdout, stderr, seconds = self.spawn(command, env=env)
        with open(os.path.join(out, "command.log"), "w") as f:
            f.write(" ".join(command) + f"\n--- exit {code}\n--- stdout\n" + stdout + "\n--- stderr\n" + stderr)
        results = [p for p in glob.glob(os.path.join(out, "*.json")) if not p.endswith(("trace.json", ".memory-estimate.json"))]
        data = json.load(open(results[0])) if len(results) == 1 else None
        run = {"json": data, "stdout": stdout, "stderr": stderr, "seconds": seconds, "code": code, "dir": out, "command": command}
        self.runs[key] = run
        if ok and code != 0:
            tail = (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise CheckFailed(f"exit {code}: {tail}")
        if ok:
            self.foreign(run)  # every run a check relies on, not only those whose losses it reads
        return run

    def check(self, path, body, group, estimate, needs=None, limit=None):
        """Plans the check `path` (run later, in order, by `execute`)."""
        if self.args.only and not any(o in path for o in self.args.only):
            return
        self.plan.append(Planned(path, body, group, estimate, needs, limit))

    # ---- the run: the plan in order, inside the budget -----------------------------------------
    def execute(self, write):
        for i, planned in enumerate(self.plan):
            self.current = planned
            earlier = [r for r in (self.earlier or {}).get("checks", []) if r.get("check", r["path"]) == planned.path]
            if earlier and all(r["verdict"] in DONE for r in earlier):
                when = self.earlier.get("commit", "?")
                self.rows += [dict(r, earlier=f"earlier run, commit {when}") for r in earlier]
                write(self.pending(i + 1))
                continue
            if planned.needs:
                self.add(planned, f"not run (needs {planned.needs})", "", seconds=None)
                write(self.pending(i + 1))
                continue
            estimate = self.measured.get(planned.path) or planned.estimate[1 if self.cpu else 0]
            left = self.deadline - time.time()
            if estimate > left:
                self.add(planned, NOT_RUN_BUDGET, f"needs about {estimate:.0f} s, {max(left, 0):.0f} s of the budget left", seconds=None)
                write(self.pending(i + 1))
                continue
            # Each check may take several times its estimate (first runs on a new node compile
            # kernels), but never past the budget.
            own = planned.limit or max(4 * estimate, estimate + 60)
            self.check_limit_is_budget = left < own
            self.check_deadline = time.time() + min(own, left)
            started = time.time()
            print(f"  ...        {planned.path}", flush=True)
            try:
                result = planned.body()
                seconds = time.time() - started
                if isinstance(result, list):
                    for row in result:
                        self.add(planned, row["verdict"], row.get("figure", ""), row.get("ratio"), row.get("detail", ""), seconds=seconds, path=row["path"])
                else:
                    self.add(planned, result[0], result[1], result[2] if len(result) > 2 else None, seconds=seconds)
            except OutOfTime as e:
                verdict = NOT_RUN_BUDGET if e.budget else FAIL
                why = f"the budget ran out after {e.seconds:.0f} s" if e.budget else f"timed out after {e.seconds:.0f} s (its limit, {own:.0f} s)"
                self.add(planned, verdict, "", None, why, seconds=time.time() - started)
            except CheckFailed as e:
                self.add(planned, FAIL, "", None, str(e), seconds=time.time() - started)
            except Exception as e:  # a bug of the harness is a failed check, not a crash
                self.add(planned, FAIL, "", None, f"{type(e).__name__}: {e}", seconds=time.time() - started)
            finally:
                self.check_deadline = None
            write(self.pending(i + 1))
        self.current = None

    def pending(self, done):
        """The rows so far and, for the checks not yet reached, a row saying so."""
        return self.rows + [{"path": p.path, "check": p.path, "group": p.group, "verdict": NOT_REACHED, "figure": "", "ratio": None, "detail": "",
                             "seconds": None} for p in self.plan[done:]]

    def interrupted(self):
        """The rows when the run is stopped by a signal: the check in progress marked so."""
        done = self.plan.index(self.current) if self.current in self.plan else len(self.plan)
        rows = list(self.rows)
        if self.current is not None and not any(r.get("check") == self.current.path for r in rows):
            rows.append({"path": self.current.path, "check": self.current.path, "group": self.current.group, "verdict": INTERRUPTED,
                         "figure": "", "ratio": None, "detail": "the run was stopped during this check", "seconds": None})
            done += 1
        return rows + [{"path": p.path, "check": p.path, "group": p.group, "verdict": NOT_REACHED, "figure": "", "ratio": None,
                        "detail": "", "seconds": None} for p in self.plan[done:]]

    def add(self, planned, verdict, figure="", ratio=None, detail="", seconds=None, path=None):
        row = {"path": path or planned.path, "check": planned.path, "group": planned.group, "verdict": verdict, "figure": figure, "ratio": ratio,
               "detail": detail, "seconds": None if seconds is None else round(seconds, 1)}
        self.rows.append(row)
        mark = {PASS: "ok", FAIL: "FAIL", BELOW: "below goal"}.get(verdict, verdict)
        took = "" if seconds is None else f" [{seconds:.0f} s]"
        print(f"  {mark:10} {row['path']}: {figure}{' (' + detail + ')' if detail and verdict != PASS else ''}{took}", flush=True)

    # ---- what a run shows ---------------------------------------------------------------------
    @staticmethod
    def losses(run):
        losses = (run["json"] or {}).get("step_losses") or []
        if not losses:
            raise CheckFailed("the results have no step_losses")
        return losses

    @staticmethod
    def foreign(run):
        lines = [line for line in run["stderr"].splitlines() if FOREIGN_STDERR.search(line)]
        if lines:
            raise CheckFailed(f"foreign lines on stderr: {lines[0][:160]}")

    def healthy(self, run, falling=True):
        """Finite losses, falling over the run (first third's mean above the last third's), and
        nothing foreign on stderr: the figure, or CheckFailed."""
        losses = self.losses(run)
        if not all(math.isfinite(x) for x in losses):
            raise CheckFailed(f"a loss is not finite: {losses[:8]}...")
        third = max(1, len(losses) // 3)
        first, last = sum(losses[:third]) / third, sum(losses[-third:]) / third
        if falling and not last < first:
            raise CheckFailed(f"losses did not fall: {first:.4f} -> {last:.4f} over {len(losses)} steps")
        self.foreign(run)
        throughput = run["json"].get("steady_throughput") or run["json"].get("throughput")
        unit = run["json"].get("throughput_unit", "images/s")
        return f"loss {first:.3f} -> {last:.3f} in {len(losses)} steps, {throughput:,.0f} {unit}"

    @staticmethod
    def same_losses(a, b, tolerance, steps=None):
        """Largest relative difference of two runs' step losses (over the shorter, or its first
        `steps`), or CheckFailed saying where they parted: the first step beyond the tolerance,
        the worst, and the first steps' losses of both."""
        la, lb = Harness.losses(a), Harness.losses(b)
        n = min(len(la), len(lb), steps or len(la))
        gaps = [abs(x - y) / max(abs(x), 1e-3) for x, y in zip(la[:n], lb[:n])]
        worst = max(gaps)
        if not worst <= tolerance:
            first = next(i for i, g in enumerate(gaps) if not g <= tolerance)
            at = gaps.index(worst)
            head = ", ".join(f"{x:.5f}/{y:.5f}" for x, y in zip(la[:3], lb[:3]))
            raise CheckFailed(f"losses differ by {worst:.2e} (relative, step {at + 1}) over {n} steps, more than {tolerance:.0e} from step {first + 1} "
                              f"(steps 1-3: {head})")
        return f"equal over {'the first ' if steps else ''}{n} step{'s' if n > 1 else ''} (largest relative difference {worst:.1e})"

    def cached(self, key, make):
        """The run kept under `key`, or a new one (a resumed run may not have it yet)."""
        return self.runs.get(key) or make()

    # ---- data -----------------------------------------------------------------------------------
    def prepare_data(self):
        self.cifar = os.path.join(self.work, "cifar10")
        self.cifar_tiny = os.path.join(self.work, "cifar10-tiny")
        self.wikitext = os.path.join(self.work, "wikitext-2")
        gen = os.path.join(self.bin, "prepare_data")
        for out, train, test in [(self.cifar, 500 if self.cpu else 5000, 100 if self.cpu else 1000), (self.cifar_tiny, 200, 100)]:
            subprocess.run([gen, "generate", "--dataset", "cifar10", "--train", str(train), "--test", str(test), "--out", out], check=True, capture_output=True, env=self.env)
        subprocess.run([gen, "generate-text", "--out", self.wikitext], check=True, capture_output=True, env=self.env)
        # Short evaluation splits: these checks time and compare training steps.
        for split in ("valid", "test"):
            path = os.path.join(self.wikitext, f"wiki.{split}.tokens")
            lines = open(path).read().splitlines()[:200]
            open(path, "w").write("\n".join(lines) + "\n")

    # ---- the checks ----------------------------------------------------------------------------
    def image(self, key, model, precision, extra=(), steps=None, data=None):
        steps = steps or ({"cnn": 40, "resnet34": 30, "vgg19": 20}[model] if not self.cpu else 6)
        return self.run(key, "exercise1", ["--device", self.device, "--model", model, "--precision", precision, "--data-dir", data or self.cifar,
                                           "--max-steps", str(steps), "--epochs", "1", "--seed", "7", *extra])

    def nlp_size(self):
        return ["--emsize", "128", "--d-hid", "256", "--nlayers", "2", "--nhead", "2"] if self.cpu else []

    def nlp(self, key, precision="32", extra=(), steps=None, binary="exercise1_nlp", env=None, ok=True):
        """The course's model (smaller on the CPU), with Adam at 1e-3: the tutorial's SGD at lr 5
        raises the loss over its first steps before it falls."""
        return self.run(key, binary, ["--device", self.device, "--precision", precision, "--data-dir", self.wikitext, "--optimizer", "adam",
                                      "--lr", "1e-3", "--max-steps", str(steps or (8 if self.cpu else 40)), "--epochs", "1", "--seed", "7",
                                      *self.nlp_size(), *extra], env=env, ok=ok)

    def needs_cuda(self):
        return "CUDA" if self.cpu else None

    def ranks(self):
        """Ranks for the multi-process checks: one per GPU (at most 2); 2 CPU ranks on the CPU."""
        return 2 if self.cpu else min(self.gpus, 2)

    def backend(self):
        return ["--backend", "mpi" if self.cpu else "nccl"]

    def learning_checks(self):
        precisions = ["32", "16-mixed", "bf16-mixed"]
        for model, estimate in [("cnn", (12, 5)), ("resnet34", (20, 20)), ("vgg19", (25, 30))]:
            for precision in precisions:
                needs = self.needs_cuda() if (precision == "16-mixed" or model != "cnn") else None
                self.check(f"exercise1 {model} {precision}", lambda m=model, p=precision: (PASS, self.healthy(self.image(f"e1-{m}-{p}", m, p))), 1, estimate, needs)
        for precision in precisions:
            needs = self.needs_cuda() if precision == "16-mixed" else None
            self.check(f"exercise1_nlp {precision}", lambda p=precision: (PASS, self.healthy(self.nlp(f"nlp-{p}", p))), 1, (15, 6), needs)
        # Lightning 2's true half precisions: the whole model in 16 bits (16-true needs a GPU).
        for model, estimate in [("cnn", (12, 5)), ("resnet34", (20, 20))]:
            for precision in ["16-true", "bf16-true"]:
                needs = self.needs_cuda() if (precision == "16-true" or model != "cnn") else None
                self.check(f"exercise1 {model} {precision}", lambda m=model, p=precision: (PASS, self.healthy(self.image(f"e1-{m}-{p}", m, p))), 1, estimate, needs)
        for precision in ["16-true", "bf16-true"]:
            needs = self.needs_cuda() if precision == "16-true" else None
            self.check(f"exercise1_nlp {precision}", lambda p=precision: (PASS, self.healthy(self.nlp(f"nlp-{p}", p))), 1, (15, 6), needs)
        gpu = "cpu" if self.cpu else "cuda:0"
        self.check(f"exercise3 pipeline gpipe, both stages on {gpu}", lambda: (PASS, self.healthy(self.pipeline("gpipe"))), 1, (15, 8))

    def pipeline(self, schedule, extra=()):
        gpu = "cpu" if self.cpu else "cuda:0"
        flags = ["--devices", f"{gpu},{gpu}", "--data-dir", self.wikitext, "--emsize", "256", "--d-hid", "512", "--nhead", "4", "--nlayers", "4",
                 "--chunks", "4", "--batch-size", "16", "--max-steps", str(6 if self.cpu else 30), "--epochs", "1", "--seed", "7"]
        key = f"pp-{schedule}{'-' + '-'.join(extra) if extra else ''}"
        return self.run(key, "exercise3", ["pipeline", *flags, "--schedule", schedule, *extra])

    def speed_feature_checks(self):
        gpu = "cpu" if self.cpu else "cuda:0"

        # Comparisons of two paths run both with --deterministic: cuDNN's benchmark times its
        # algorithms anew in each run and may keep different ones, whose roundings Adam's
        # sign-like first steps then amplify (2.6e-3 apart after 40 steps on an H100).
        def graphed_cnn():
            run = self.image("e1-cnn-graph-det", "cnn", "32", ["--cuda-graph", "--deterministic"])
            base = self.image("e1-cnn-32-det", "cnn", "32", ["--deterministic"])
            return PASS, self.healthy(run) + "; " + self.same_losses(run, base, 1e-5)
        self.check("exercise1 cnn --cuda-graph = eager", graphed_cnn, 2, (15, 5), self.needs_cuda())

        def graphed_nlp():
            run = self.nlp("nlp-graph", "32", ["--cuda-graph"])
            base = self.cached("nlp-32", lambda: self.nlp("nlp-32"))
            return PASS, self.healthy(run) + "; " + self.same_losses(run, base, 2e-3)
        self.check("exercise1_nlp --cuda-graph = eager", graphed_nlp, 2, (20, 5), self.needs_cuda())

        layout_model = "cnn" if self.cpu else "resnet34"

        # The two layouts run different cuDNN kernels (TF32 where cuDNN's default allows it, as
        # PyTorch's), whose roundings differ; training from scratch then amplifies them: on an
        # H100, 1.7e-4 apart at step 1, 5e-3 at step 2, 0.4 by step 28, with Adam and with SGD.
        # So: the same loss on the same weights and batch (step 1), and both learn.
        def channels_last():
            run = self.image(f"e1-{layout_model}-cl-det", layout_model, "32", ["--channels-last", "--deterministic"])
            base = self.image(f"e1-{layout_model}-32-det", layout_model, "32", ["--deterministic"])
            self.healthy(base)
            return PASS, self.healthy(run) + "; " + self.same_losses(run, base, 1e-3, steps=1)
        self.check(f"exercise1 {layout_model} --channels-last: the same model", channels_last, 2, (25, 8))

        def optimizer_kernels():
            fused = self.image("e1-cnn-fused", "cnn", "32", ["--optimizer-kernel", "fused", "--deterministic"])
            single = self.image("e1-cnn-per-parameter", "cnn", "32", ["--optimizer-kernel", "per-parameter", "--deterministic"])
            # The kernels round differently in the last bits, which Adam's first, sign-like
            # updates amplify: on an H100 equal to 1e-3 up to step 22, 1e-2 apart at step 40.
            return PASS, self.same_losses(fused, single, 1e-3, steps=10)
        self.check("exercise1 cnn Adam: fused kernel = per-parameter", optimizer_kernels, 2, (20, 8))
        self.check("exercise1 cnn --data-on-device", lambda: (PASS, self.healthy(self.image("e1-cnn-resident", "cnn", "32", ["--data-on-device"]))), 2, (12, 5))
        self.check("exercise1 cnn --matmul-precision high", lambda: (PASS, self.healthy(self.image("e1-cnn-tf32", "cnn", "32", ["--matmul-precision", "high"]))), 2, (12, 5))

        def schedule(s):
            run = self.pipeline(s)
            base = self.cached("pp-gpipe", lambda: self.pipeline("gpipe"))
            return PASS, self.healthy(run) + "; " + self.same_losses(run, base, 2e-3) + " with gpipe"
        for s in ["1f1b", "interleaved"]:
            self.check(f"exercise3 pipeline {s} = gpipe, both stages on {gpu}", lambda s=s: schedule(s), 2, (15, 8))
        self.check("exercise3 pipeline gpipe 16-mixed (gradient scaler)", lambda: (PASS, self.healthy(self.pipeline("gpipe", ["--precision", "16-mixed"]))), 2, (15, 8),
                   self.needs_cuda())

        def resume():
            ckpt = os.path.join(self.work, "ckpt")
            flags = ["--data-dir", self.cifar_tiny, "--batch-size", "20", "--seed", "7", "--device", self.device, "--checkpoint-dir"]
            straight = self.run("e1-straight", "exercise1", flags + [os.path.join(ckpt, "a"), "--epochs", "2"])
            self.run("e1-first", "exercise1", flags + [os.path.join(ckpt, "b"), "--epochs", "1"])
            resumed = self.run("e1-resumed", "exercise1", flags + [os.path.join(ckpt, "b"), "--epochs", "2", "--resume"])
            tail = self.losses(straight)[-len(self.losses(resumed)):]
            worst = max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(tail, self.losses(resumed)))
            if worst > 1e-3 or resumed["json"]["resumed_epochs"] != 1:
                raise CheckFailed(f"epoch 2 resumed differs from straight by {worst:.2e} (resumed_epochs {resumed['json']['resumed_epochs']})")
            return PASS, f"epoch 2 after --resume = straight (largest relative difference {worst:.1e})"
        self.check("exercise1 checkpoint + --resume", resume, 2, (25, 12))
        self.image_file_checks()

    def image_file_setup(self):
        batch, steps, side = (4, 3, 32) if self.cpu else (256, 24, 224)
        fast = [] if self.cpu else ["--precision", "bf16-mixed", "--channels-last"]
        common = ["--device", self.device, "--model", "resnet50", "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--epochs", "1",
                  "--seed", "7", *fast]
        photos = os.path.join(self.work, "photos")
        if not os.path.isdir(photos):
            subprocess.run([os.path.join(self.bin, "prepare_data"), "generate-images", "--out", photos, "--classes", "10", "--train", str(-(-batch * steps // 10) + 2),
                            "--val", "1"], check=True, capture_output=True, env=self.env)
        return batch, steps, side, fast, common, photos

    def image_file_checks(self):
        """The JSC exercise: ResNet50 from JPEG files (ImageNet's sizes), decoded on every core, at
        batch 256 in bf16 channels-last on a GPU. The loader keeps up when the steady throughput
        from the files is at least 95% of the same model's fed from memory (CIFAR-10 resized to
        224 on the GPU): that is a data wait under 5% of the step. (On the CPU: batch 4 at 32×32.)"""
        batch = 4 if self.cpu else 256
        label = f"batch {batch}{'' if self.cpu else ' bf16 channels-last'}"

        def keeps_up():
            batch, steps, side, fast, common, photos = self.image_file_setup()
            files = self.run("r50-files", "exercise1", [*common, "--dataset", "imagefolder", "--data-dir", photos])
            memory = self.run("r50-memory", "exercise1", [*common, "--data-dir", self.cifar])
            figure = self.healthy(files, falling=False)
            share = files["json"]["steady_throughput"] / memory["json"]["steady_throughput"]
            wait = files["json"]["data_wait_s"] / files["json"]["train_time_s"]
            verdict = PASS if share >= 0.95 or self.cpu else BELOW
            return verdict, f"{figure}; {100 * share:.0f}% of the throughput fed from memory; data wait {100 * wait:.1f}% of training (first batch included)"
        self.check(f"exercise1 resnet50 from JPEG files, {label}: the loader keeps up", keeps_up, 2, (40, 15))

    def nccl_checks(self):
        n = self.ranks()
        over = "MPI (CPU ranks)" if self.cpu else "NCCL"
        common = ["--nproc-per-node", str(n), *self.backend(), "--device", self.device, "--seed", "7"]
        steps = "6" if self.cpu else "30"
        image = ["--data-dir", self.cifar, "--max-steps", steps, "--epochs", "1"]
        self.check(f"exercise2 (Horovod style) over {over}, {n} rank(s)", lambda: (PASS, self.healthy(self.run(f"e2-{n}", "exercise2", common + image))), 3, (25, 10))
        self.check(f"exercise3 ddp over {over}, {n} rank(s)", lambda: (PASS, self.healthy(self.run(f"ddp-{n}", "exercise3", ["ddp", *common, *image]))), 3, (30, 10))
        small = ["--emsize", "256", "--d-hid", "512", "--nhead", "4", "--nlayers", "2"] if not self.cpu else ["--emsize", "64", "--d-hid", "128", "--nhead", "2", "--nlayers", "2"]
        # Adam at 1e-3, as exercise1_nlp's checks: the tutorial's SGD at lr 5 first raises the loss.
        adam = ["--optimizer", "adam", "--lr", "1e-3"]
        tp_steps = "12" if self.cpu else steps  # the tiny CPU model's loss falls slowly here
        tp_flags = ["tp", *common, "--tp", str(n), "--data-dir", self.wikitext, *small, *adam, "--pad-vocab", "8", "--max-steps", tp_steps, "--epochs", "1"]
        self.check(f"exercise3 tp over {over}, {n} rank(s)", lambda: (PASS, self.healthy(self.run(f"tp-{n}", "exercise3", tp_flags))), 3, (25, 10))
        for zero in [1, 2, 3]:
            flags = [*common, "--zero", str(zero), "--optimizer", "adam", "--lr", "1e-3", "--data-dir", self.wikitext, "--max-steps", steps, "--epochs", "1", *small]
            self.check(f"exercise1_nlp --zero {zero} over {over}, {n} rank(s)", lambda f=flags, z=zero: (PASS, self.healthy(self.run(f"zero{z}-{n}", "exercise1_nlp", f))),
                       3, (25, 10))
        if not self.cpu and self.gpus >= 2:
            one = ["--nproc-per-node", "1", "--backend", "nccl", "--device", "cuda", "--seed", "7"]

            def two_equal_one(two_key, one_key, binary, flags):
                two = self.runs.get(two_key)
                if two is None:
                    raise CheckFailed(f"the 2-rank run ({two_key}) did not run")
                single = self.cached(one_key, lambda: self.run(one_key, binary, flags))
                return PASS, self.same_losses(two, single, 2e-3)
            tp_one = ["tp", *one, "--tp", "1", "--data-dir", self.wikitext, *small, *adam, "--pad-vocab", "8", "--max-steps", steps, "--epochs", "1"]
            self.check("exercise3 tp: 2 ranks train the model of 1", lambda: two_equal_one("tp-2", "tp-1", "exercise3", tp_one), 3, (25, 10))
            for zero in [1, 2, 3]:
                flags = [*one, "--zero", str(zero), "--optimizer", "adam", "--lr", "1e-3", "--data-dir", self.wikitext, "--max-steps", steps, "--epochs", "1", *small]
                self.check(f"--zero {zero}: 2 ranks = 1 rank", lambda z=zero, f=flags: two_equal_one(f"zero{z}-2", f"zero{z}-1", "exercise1_nlp", f), 3, (25, 10))

        # The watchdog runs on ZeRO-1's collectives (a reduce-scatter and an all-gather each step).
        watched = [*common, "--zero", "1", "--optimizer", "adam", "--lr", "1e-3", "--data-dir", self.wikitext, "--max-steps", steps, "--epochs", "1", *small]

        def watchdog_quiet():
            run = self.run(f"watch-quiet-{n}", "exercise1_nlp", watched + ["--collective-timeout", "20"])
            figure = self.healthy(run)
            if "--collective-timeout" in run["stderr"]:
                raise CheckFailed("the watchdog fired in a healthy run: " + run["stderr"].strip().splitlines()[-1][:160])
            return PASS, f"{figure}; the watchdog (20 s) stayed quiet"
        # One rank alone has no collective at all (a group of one is this rank alone), so the
        # watchdog has nothing to watch: the checks need two ranks, on the GPU two GPUs.
        two = None if self.cpu or n >= 2 else "2 GPUs: one rank runs no collective"
        self.check(f"collective watchdog over {over}: a healthy ZeRO-1 run with --collective-timeout 20 runs through", watchdog_quiet, 3, (25, 10), two)

        def watchdog_fires():
            # Operation 3 of the last rank never completes for that rank (a test hook): past the
            # timeout the job must end with the watchdog's exit code 3, in one line naming the
            # operation. (A group's first operation waits at least 5 minutes, start-up in mind:
            # the stall is put on a later one.)
            timeout = 5
            env = dict(self.env, COURSE_TEST_STALL_COLLECTIVE=f"{n - 1}:3")
            started = time.time()
            run = self.run(f"watch-fires-{n}", "exercise1_nlp", watched + ["--collective-timeout", str(timeout)], ok=False, env=env)
            took = time.time() - started
            line = next((line for line in run["stderr"].splitlines() if "--collective-timeout" in line), None)
            if run["code"] != 3 or line is None:
                tail = (run["stderr"].strip().splitlines() or ["(nothing on stderr)"])[-1]
                raise CheckFailed(f"exit {run['code']} (expected 3, the watchdog's): {tail[:160]}")
            if not re.search(r"operation #?\d+", line):
                raise CheckFailed(f"the line does not name the operation: {line[:160]}")
            return PASS, f"ended in {took:.0f} s (exit 3): {line.strip()[:140]}"
        self.check(f"collective watchdog over {over}: a rank whose collective never completes ends the job, naming it", watchdog_fires, 3, (40, 20), two)

        def pipeline_processes():
            flags = ["pipeline", "--nproc-per-node", str(n), *self.backend(), "--device", self.device, "--data-dir", self.wikitext, *small, *adam, "--chunks", "4",
                     "--batch-size", "16", "--max-steps", steps, "--epochs", "1", "--seed", "7"]
            return PASS, self.healthy(self.run(f"pp-processes-{n}", "exercise3", flags))
        stages = f"{n} stage process(es)"
        self.check(f"exercise3 pipeline across {stages} over {over}", pipeline_processes, 3, (25, 10))

        def sharded_resume():
            flags = [*common, "--zero", "3", "--optimizer", "adam", "--lr", "1e-3", "--data-dir", self.wikitext, "--epochs", "1", *small,
                     "--checkpoint-format", "sharded"]
            total, half = (8, 4) if self.cpu else (20, 10)
            ckpt = os.path.join(self.work, "sharded")
            straight = self.run(f"sharded-straight-{n}", "exercise1_nlp", flags + ["--max-steps", str(total)])
            self.run(f"sharded-first-{n}", "exercise1_nlp", flags + ["--max-steps", str(half), "--checkpoint-every", str(half), "--checkpoint-dir", ckpt])
            shards = glob.glob(os.path.join(ckpt, "*.shards"))
            if not shards:
                raise CheckFailed(f"no sharded checkpoint (<run>.shards/) in {ckpt}: {os.listdir(ckpt) if os.path.isdir(ckpt) else 'no folder'}")
            resumed = self.run(f"sharded-resumed-{n}", "exercise1_nlp", flags + ["--max-steps", str(total), "--checkpoint-dir", ckpt, "--resume"])
            tail, again = self.losses(straight)[half:], self.losses(resumed)[-(total - half):]
            worst = max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(tail, again))
            if len(again) != total - half or worst > 2e-3:
                raise CheckFailed(f"steps {half + 1}-{total} resumed differ from straight by {worst:.2e} over {len(again)} steps")
            return PASS, f"steps {half + 1}-{total} resumed from {os.path.basename(shards[0])} = straight (largest relative difference {worst:.1e})"
        self.check(f"sharded checkpoint over {over}: written by ZeRO-3 ranks, resumed mid-epoch = straight", sharded_resume, 3, (50, 20))

        def parameter_server():
            # The workers share the steps: enough of them for each worker's losses to fall.
            workers = n
            flags = ["--nproc-per-node", str(workers + 1), "--strategy", "parameter-server", "--sync", "--device", self.device, "--model", "cnn",
                     "--data-dir", self.cifar, "--max-steps", "20" if self.cpu else "60", "--epochs", "5", "--seed", "7"]
            run = self.run(f"ps-{workers}", "exercise2", flags)
            return PASS, self.healthy(run) + f"; {workers} worker(s) on {self.device}, 1 server on the CPU"
        self.check(f"exercise2 --strategy parameter-server: {n} worker(s) on {'the CPU' if self.cpu else 'the GPU'}, the server on the CPU", parameter_server, 3,
                   (30, 12))

    def profile_and_memory_checks(self):
        def profile():
            run = self.image("e1-profile", "cnn", "32", ["--profile-steps", "3..5"], steps=6)
            out = run["stdout"]
            unit = "CPU" if self.cpu else "CUDA"
            if f"operators and kernels by self {unit} time" not in out or "aten::" not in out:
                raise CheckFailed("no operator table in the output")
            trace = glob.glob(os.path.join(run["dir"], "*.torch-trace.json"))
            events = json.load(open(trace[0]))["traceEvents"]
            kernels = sum(1 for e in events if e.get("cat") == "kernel")
            if not self.cpu and kernels == 0:
                raise CheckFailed("the trace has no CUDA kernels")
            return PASS, f"{len(events)} trace events, {kernels} kernels"
        self.check("--profile: LibTorch's profiler, operators and kernels", profile, 4, (15, 6))

        def memory(name, binary, flags):
            estimate_dir = os.path.join(self.work, f"estimate-{name}")
            code, _, err, _ = self.spawn([os.path.join(self.bin, binary), *flags, "--estimate-memory", "--results-dir", estimate_dir])
            if code != 0:
                raise CheckFailed(f"--estimate-memory: exit {code}: {(err.strip().splitlines() or ['?'])[-1]}")
            estimated = json.load(open(glob.glob(os.path.join(estimate_dir, "*.memory-estimate.json"))[0]))["ranks"][0]["total"]
            run = self.run(f"mem-{name}", binary, [*flags, "--max-steps", "4", "--epochs", "1"])
            peak = run["json"]["peak_memory"][0]
            measured = peak["training_peak_bytes"] - peak["baseline_bytes"]
            ratio = estimated / measured
            figure = f"estimated {estimated / 2**20:,.0f} MiB, measured {measured / 2**20:,.0f} MiB ({100 * (ratio - 1):+.0f}%)"
            if peak.get("peak_reserved_bytes"):
                figure += f", reserved {peak['peak_reserved_bytes'] / 2**20:,.0f} MiB"
            return (PASS if abs(ratio - 1) <= 0.2 else BELOW), figure
        nlp = ["--device", self.device, "--data-dir", self.wikitext, *self.nlp_size()]
        self.check("peak memory vs --estimate-memory: exercise1_nlp 32", lambda: memory("nlp-32", "exercise1_nlp", nlp), 4, (20, 8))
        self.check("peak memory vs --estimate-memory: exercise1_nlp bf16-mixed", lambda: memory("nlp-bf16", "exercise1_nlp", [*nlp, "--precision", "bf16-mixed"]), 4, (20, 8))
        for model, estimate in [("cnn", (15, 8)), ("resnet34", (25, 25))]:
            flags = ["--device", self.device, "--model", model, "--data-dir", self.cifar]
            needs = self.needs_cuda() if model != "cnn" else None
            self.check(f"peak memory vs --estimate-memory: exercise1 {model} 32", lambda m=model, f=flags: memory(f"e1-{m}", "exercise1", f), 4, estimate, needs)
        # Without cuDNN's benchmark (which tries its algorithms with their workspaces on the first
        # step): how much of the convolutional models' peak those trials are.
        flags = ["--device", self.device, "--model", "resnet34", "--data-dir", self.cifar, "--deterministic"]
        self.check("peak memory vs --estimate-memory: exercise1 resnet34 32 --deterministic (no cuDNN benchmark)",
                   lambda: memory("e1-resnet34-det", "exercise1", flags), 4, (25, 25), self.needs_cuda())

    def timing_checks(self):
        """Side by side with PyTorch eager through bench/bench.sh (warm caches, A B A B)."""
        if self.args.no_timings:
            return
        plans = [("32", False, "cnn resnet34 vgg19 nlp"), ("bf16-mixed", False, "cnn resnet34 vgg19 nlp"), ("32", True, "cnn nlp")]
        if self.cpu:
            plans = [("32", False, "cnn")]
        for precision, graph, entries in plans:
            label = f"{precision}{' --cuda-graph' if graph else ''}"
            self.check(f"timing {label}: {entries}", lambda p=precision, g=graph, e=entries: self.bench(p, g, e), 5,
                       (30 + 40 * len(entries.split()) * self.args.rounds, 40))
        self.check(f"timing exercise1 resnet50 from JPEG files, batch {4 if self.cpu else 256}: against PyTorch + torchvision's DataLoader", self.jpeg_against_pytorch, 5,
                   (90, 30))
        self.check("timing exercise1 cnn: against pytorch-lightning's Trainer", self.against_lightning, 5, (60, 30), None if self.has_lightning() else "pytorch_lightning")

    def bench(self, precision, graph, entries):
        # The timings read a whole-sized CIFAR-10 (a generated one: the figures are throughput).
        full = os.path.join(self.work, "cifar10-full")
        if not os.path.isdir(full):
            subprocess.run([os.path.join(self.bin, "prepare_data"), "generate", "--dataset", "cifar10", "--out", full], check=True, capture_output=True, env=self.env)
        csv_path = os.path.join(self.work, f"bench-{precision}-{graph}.csv")
        env = dict(self.env, DEVICE=self.device, PRECISION=precision, BENCH=entries, ROUNDS=str(self.args.rounds), PEERS="", BIN=self.bin,
                   BENCH_CSV=csv_path, CUDA_GRAPH="1" if graph else "0", TORCH_PYTHON=self.python, CIFAR_DIR=full, WIKITEXT_DIR=self.wikitext,
                   CNN_STEPS="30" if not self.cpu else "4", RESNET34_STEPS="15", VGG19_STEPS="10", NLP_STEPS="15", MIN_SECONDS="2" if not self.cpu else "0.2",
                   BENCH_NOTE="gpu-check")
        label = f"{precision}{' --cuda-graph' if graph else ''}"
        code, out, err, _ = self.spawn(["bash", os.path.join(ROOT, "bench", "bench.sh")], env=env)
        open(os.path.join(self.work, f"bench-{precision}-{graph}.log"), "w").write(out + err)
        if code != 0:
            raise CheckFailed((err.strip().splitlines() or ["bench.sh failed"])[-1])
        import csv
        rows = []
        for row in csv.DictReader(open(csv_path)):
            entry = row["model"] if row["exercise"] == "exercise1" else "nlp"
            ratio = float(row.get("ratio_rounds_median") or row["ratio"])
            goal = GOALS.get((entry, precision, graph), 1.0)
            figure = f"{float(row['rust_throughput']):,.0f} vs {float(row['pytorch_throughput']):,.0f} {row['unit']} (goal {goal:.1f}x)"
            rows.append({"path": f"timing {'exercise1 ' + entry if entry != 'nlp' else 'exercise1_nlp'} {label}", "verdict": PASS if ratio >= goal else BELOW,
                         "figure": figure, "ratio": ratio})
        return rows

    def jpeg_against_pytorch(self):
        """Side by side with PyTorch eager fed by torchvision's DataLoader(ImageFolder), as many
        worker processes as our loader's threads, the same model, batch and precision (A B A B)."""
        batch, steps, side, fast, common, photos = self.image_file_setup()
        workers = str(len(os.sched_getaffinity(0)))
        reference = [self.python, os.path.join(ROOT, "bench", "exercise1_reference.py"), "--model", "resnet50", "--loader", "imagefolder", "--data-dir", photos,
                     "--device", self.device, "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--workers", workers,
                     "--steady-after", "2"] + (["--precision", "bf16-mixed", "--channels-last"] if fast else [])
        a, b = self.alternate("r50-files", [*common, "--dataset", "imagefolder", "--data-dir", photos, "--workers", workers], reference, "PyTorch")
        return (PASS if a >= b else BELOW), f"{a:,.0f} vs {b:,.0f} images/s (goal 1.0x)", a / b

    def alternate(self, key, ours, reference, peer):
        """exercise1 with the flags `ours` and the `reference` command, alternately (A B A B,
        --rounds rounds): the medians of their steady throughputs."""
        mine, theirs = [], []
        for round in range(max(1, self.args.rounds)):
            mine.append(self.run(f"{key}-{round}", "exercise1", ours)["json"]["steady_throughput"])
            code, out, err, _ = self.spawn(reference, env=self.python_env)
            if code != 0:
                raise CheckFailed(f"the {peer} reference failed: " + (err.strip().splitlines() or ["?"])[-1])
            theirs.append(json.loads(out.strip().splitlines()[-1])["steady_throughput"])
        return sorted(mine)[len(mine) // 2], sorted(theirs)[len(theirs) // 2]

    def has_lightning(self):
        if self.lightning is None:
            try:
                probe = subprocess.run([self.python, "-c", "import pytorch_lightning"], capture_output=True, timeout=120)
                self.lightning = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                self.lightning = False
        return self.lightning

    def against_lightning(self):
        """exercise1's CNN against the same model, data, batch and optimizer trained by
        pytorch-lightning's Trainer (bench/exercise1_lightning.py), steady state, A B A B."""
        steps = 8 if self.cpu else 200
        flags = ["--device", self.device, "--model", "cnn", "--data-dir", self.cifar, "--max-steps", str(steps), "--epochs", "1000", "--steady-after", "3"]
        reference = [self.python, os.path.join(ROOT, "bench", "exercise1_lightning.py"), "--data-dir", self.cifar, "--device", self.device,
                     "--max-steps", str(steps), "--steady-after", "3"]
        a, b = self.alternate("e1-vs-lightning", flags, reference, "Lightning")
        return (PASS if a >= b else BELOW), f"{a:,.0f} vs {b:,.0f} images/s over {steps} steps (goal 1.0x)", a / b

    def big_model_checks(self):
        """The 1.4B-parameter Transformer's MFU at a batch that fills the GPU."""
        flags = ["--device", "cuda", "--data-dir", self.wikitext, "--emsize", "4096", "--d-hid", "4096", "--nhead", "16", "--nlayers", "12",
                 "--bptt", "512", "--batch-size", "16", "--precision", "bf16-mixed", "--optimizer", "adam", "--lr", "1e-4", "--max-steps", "12",
                 "--epochs", "1", "--dropout", "0"]

        def mfu():
            run = self.run("big", "exercise1_nlp", flags)
            figure = self.healthy(run, falling=False)
            data = run["json"]
            peak = data.get("peak_tflops")
            steady = data.get("steady_throughput") or data["throughput"]
            if not peak:
                return SKIPPED, figure + "; no known peak for this GPU (give --peak-tflops)"
            mfu = data["flops_per_example"] * steady / 1e12 / peak
            return (PASS if mfu >= MFU_GOAL else BELOW), f"{figure}; MFU {100 * mfu:.1f}% of {peak:.0f} TFLOP/s (goal {100 * MFU_GOAL:.0f}%)"
        self.check("1.4B Transformer bf16-mixed, 16 x 512 tokens: MFU", mfu, 6, (90, 0), self.needs_cuda())

    def planner_checks(self):
        """The layout planner's profile of this machine, kept beside the table."""
        # Absolute: the binaries run in the checkout (or bundle) folder, not this process's.
        out = os.path.abspath(os.path.join(self.args.results, "plan-profile.json" if not self.cpu else "plan-profile-cpu.json"))
        if self.cpu:
            model = ["--device", "cpu", "--emsize", "32", "--d-hid", "64", "--nhead", "4", "--nlayers", "2", "--bptt", "8", "--micro-batches", "1,2", "--max-message-mb", "1"]
        else:
            model = ["--device", "cuda", "--precision", "bf16-mixed", "--nlayers", "12", "--bptt", "512", "--micro-batches", "1,2,4,8,16"]
        ranks = self.gpus if self.gpus >= 2 else (2 if self.cpu else 1)
        flags = model + (["--nproc-per-node", str(ranks)] if ranks > 1 else []) + ["--out", out]

        def profile():
            code, stdout, stderr, _ = self.spawn([os.path.join(self.bin, "exercise3"), "profile"] + flags)
            if code != 0:
                raise CheckFailed(f"exit {code}: " + (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1])
            recorded = json.load(open(out))
            sizes = [p["micro_batch"] for p in recorded["compute"]]
            layer = {p["micro_batch"]: 1e3 * (p["layer"]["forward_s"] + p["layer"]["backward_s"]) for p in recorded["compute"]}
            links = ", ".join(f"{link['scope']} all-reduce {1 / link['collectives']['all-reduce']['seconds_per_bus_byte'] / 1e9:.1f} GB/s"
                              for link in recorded["links"] if link["collectives"]["all-reduce"]["seconds_per_bus_byte"] > 0)
            figure = f"one layer fwd+bwd {', '.join(f'{layer[b]:.2f} ms at {b}' for b in sizes)}; {links or 'no collectives (one rank)'}; kept as {os.path.basename(out)}"
            return PASS, figure
        self.check("exercise3 profile: the planner's profile (1.4B, bf16-mixed, 512 tokens)", profile, 7, (60, 20))
        self.check("the plan against runs on one GPU: step time and peak memory of every layout that fits, at 3 global batches",
                   lambda: self.plan_against_runs(out), 7, (120, 40))

    def plan_against_runs(self, profile):
        """`exercise3 plan` for one GPU from the profile just recorded, at a few global batches;
        every layout it ranks run for a few steps; predicted against measured step time (steady
        state) and peak memory (bytes tensors held in training over what they held before), as
        `make bench-plan` compares them on CPU ranks. The rows go to <results>/plan-check.csv in
        bench-plan.csv's columns."""
        if not os.path.exists(profile):
            raise CheckFailed("no profile (the check before this one did not record it)")
        if self.cpu:
            model = ["--emsize", "32", "--d-hid", "64", "--nhead", "4", "--nlayers", "2", "--bptt", "8", "--precision", "32"]
            batches, steps, memory = [2, 4], 6, "1GiB"
        else:
            model = ["--emsize", "4096", "--d-hid", "4096", "--nhead", "16", "--nlayers", "12", "--bptt", "512", "--precision", "bf16-mixed"]
            batches, steps, memory = [8, 16, 32], 10, "78GiB"
        plan_model = [model[i + j] for i in range(0, len(model), 2) if model[i] in ("--emsize", "--nlayers", "--precision") for j in (0, 1)]
        bptt = int(model[model.index("--bptt") + 1])
        # The profile's vocabulary is WikiText-2's (its default); the generated text has fewer
        # words, so the runs pad theirs up to it: the same model the plan predicts.
        vocab = str(json.load(open(profile))["model"]["ntoken"])
        rows, lines = [], []
        for batch in batches:
            code, stdout, stderr, _ = self.spawn([os.path.join(self.bin, "exercise3"), "plan", "--profile", profile, "--nodes", "1", "--gpus-per-node", "1",
                                                  "--memory", memory, "--global-batch", str(batch), *plan_model, "--json"])
            if code != 0:
                raise CheckFailed(f"exercise3 plan: exit {code}: " + (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1])
            for rank, predicted in enumerate(json.loads(stdout)["ranked"], 1):
                binary, *layout = predicted["command"].split()
                run = self.run(f"plan-b{batch}-{rank}", binary, ["--device", self.device, "--data-dir", self.wikitext, *model, "--pad-vocab", vocab,
                                                                 "--optimizer", "adam", "--lr", "1e-4", "--max-steps", str(steps), "--epochs", "1", *layout])
                data = run["json"]
                step = data["global_batch"] * data["bptt"] / data["steady_throughput"]
                held = max(p["training_peak_bytes"] - p["baseline_bytes"] for p in data["peak_memory"])
                rows.append((batch, rank, predicted, step, held))
                lines.append(f"{' '.join(layout)}: {1e3 * predicted['step_s']:.0f} vs {1e3 * step:.0f} ms ({predicted['step_s'] / step - 1:+.0%}), "
                             f"{predicted['memory_bytes'] / 2**30:.2f} vs {held / 2**30:.2f} GiB ({predicted['memory_bytes'] / held - 1:+.0%})")
        if not rows:
            raise CheckFailed(f"no layout fits in {memory} at global batches {batches}")
        cluster = f"1x{'GPU' if not self.cpu else 'CPU'} {self.gpu_name or self.device}".strip()
        started = int(self.started)
        header = "bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,predicted_memory_bytes,measured_memory_bytes,compute_s,tp_comm_s,bubble_s,exposed_comm_s,optimizer_s"
        with open(os.path.join(self.args.results, "plan-check.csv"), "w") as f:
            f.write(header + "\n")
            for batch, rank, p, step, held in rows:
                f.write(",".join(map(str, [started, f'"{cluster} global batch {batch}"', rank, f'"{p["command"]}"', p["step_s"], f"{step:.6f}", p["memory_bytes"],
                                           held, p["compute_s"], p["tp_comm_s"], p["bubble_s"], p["exposed_comm_s"], p["optimizer_s"]])) + "\n")
        time_errors = sorted(abs(p["step_s"] / step - 1) for _, _, p, step, _ in rows)
        memory_errors = [abs(p["memory_bytes"] / held - 1) for _, _, p, _, held in rows]
        median = time_errors[len(time_errors) // 2] if len(time_errors) % 2 else sum(time_errors[len(time_errors) // 2 - 1:][:2]) / 2
        met = median <= 0.10 and time_errors[-1] <= 0.20 and max(memory_errors) <= 0.05
        figure = (f"{len(rows)} layouts: step time error median {median:.0%}, worst {time_errors[-1]:.0%}; memory worst {max(memory_errors):.0%} "
                  f"(goals 10%, 20%, 5%); " + "; ".join(lines))
        return (PASS if met else BELOW), figure

    def plan_all(self):
        for group in (self.learning_checks, self.speed_feature_checks, self.nccl_checks, self.profile_and_memory_checks, self.timing_checks,
                      self.big_model_checks, self.planner_checks):
            group()


def kill_group(proc):
    """Ends `proc` and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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


def read_table(path, what):
    """A recorded check (its .json, or the .md beside it), or one line and exit 2."""
    if path.endswith(".md") and os.path.exists(path[:-3] + ".json"):
        path = path[:-3] + ".json"
    try:
        recorded = json.load(open(path))
        if not isinstance(recorded.get("checks"), list):
            raise ValueError("no list of checks")
        return recorded
    except (OSError, ValueError, AttributeError) as e:
        print(f"gpu-check: cannot read the recorded check {path} ({what}): {e}", file=sys.stderr)
        sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("BIN", os.path.join(ROOT, "target", "release")), help="where the binaries are (BIN)")
    p.add_argument("--python", default=os.environ.get("TORCH_PYTHON", sys.executable), help="a Python with PyTorch 2.11 (TORCH_PYTHON)")
    p.add_argument("--results", "--out", default=os.path.join(ROOT, "results"), help="where gpu-check.json and gpu-check.md go")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help=f"seconds for the whole run, data included (default {DEFAULT_BUDGET})")
    p.add_argument("--resume-from", metavar="TABLE", help="a recorded check: keep what passed, run only what was skipped, cut short or failed")
    p.add_argument("--plan-from", metavar="TABLE", help="a recorded check whose wall times plan this run's budget (it runs every check)")
    p.add_argument("--table", metavar="JSON", help="print the table of a recorded check and exit with its verdict")
    p.add_argument("--only", action="append", help="run only the checks whose path contains this (repeatable)")
    p.add_argument("--no-timings", action="store_true", help="skip the side-by-side timings against PyTorch")
    p.add_argument("--rounds", type=int, default=1, help="A/B rounds of each timing (bench.sh's ROUNDS)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the harness's own test, the checks that need no CUDA, tiny")
    p.add_argument("--keep", action="store_true", help="keep the runs' folder (logs, results)")
    args = p.parse_args()

    if args.table:
        recorded = read_table(args.table, "--table")
        print(table(recorded["checks"], header_of(recorded)), end="")
        return verdict_exit(recorded["checks"])
    if not args.budget > 0:
        print(f"gpu-check: --budget must be a positive number of seconds, got {args.budget:g}", file=sys.stderr)
        return 2
    earlier = read_table(args.resume_from, "--resume-from") if args.resume_from else None
    plan_from = read_table(args.plan_from, "--plan-from") if args.plan_from else None

    gpus, name = detect_gpus(args.python)
    if args.device == "cuda" and gpus == 0:
        why = f"{args.python}: " + (name if name.startswith("(") else "torch.cuda.is_available() is False")
        print(f"gpu-check: no CUDA GPU on this machine ({why}); run it on a GPU node", file=sys.stderr)
        return 2
    missing = [b for b in ("exercise1", "exercise1_nlp", "exercise2", "exercise3", "prepare_data") if not os.access(os.path.join(args.bin, b), os.X_OK)]
    if missing:
        print(f"gpu-check: no {', '.join(missing)} in {args.bin}: build them (make build) or point BIN at the prebuilt binaries", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.results, exist_ok=True)
    except OSError as e:
        print(f"gpu-check: cannot write the results folder {args.results}: {e}", file=sys.stderr)
        return 2

    h = Harness(args, args.device, gpus, name, earlier, plan_from)
    stem = "gpu-check" if args.device == "cuda" else "gpu-check-cpu"
    json_path, md_path = os.path.join(args.results, f"{stem}.json"), os.path.join(args.results, f"{stem}.md")

    def record(rows):
        recorded = {
            "finished_at": int(time.time()), "seconds": round(time.time() - h.started), "budget": args.budget, "device": args.device, "gpu": name,
            "gpus": gpus, "torch_python": args.python, "binaries": args.bin, "commit": git_commit(),
            "resumed_from": None if earlier is None else {"path": args.resume_from, "commit": earlier.get("commit"), "finished_at": earlier.get("finished_at")},
            "complete": all(r["verdict"] in (PASS, FAIL, BELOW, SKIPPED) or r["verdict"].startswith("not run (needs") for r in rows), "checks": rows,
        }
        # The table a person reads first, then the record --resume-from reads: a run killed
        # between the two leaves a record no further along than its table.
        write_atomically(md_path, table(rows, header_of(recorded)))
        write_atomically(json_path, json.dumps(recorded, indent=2) + "\n")
        return recorded

    def stop(signum, _frame):
        # A signal (the allocation's end, Ctrl-C): end the run in progress and leave the table
        # with the check in progress marked, so that --resume-from goes on from there.
        if h.child is not None:
            kill_group(h.child)
        record(h.interrupted())
        print(f"\ngpu-check: stopped by signal {signum}; the table so far is in {md_path} (--resume-from {json_path} goes on)", file=sys.stderr)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    where = name or "the CPU"
    print(f"gpu-check on {where} ({gpus} GPU(s)), binaries in {args.bin}; budget {args.budget:.0f} s; runs in {h.work}", flush=True)
    if earlier is not None:
        print(f"resuming {args.resume_from} (commit {earlier.get('commit', '?')}): what passed there is kept", flush=True)
    h.prepare_data()
    h.plan_all()
    record(h.pending(0))
    print(f"{len(h.plan)} checks planned (data ready after {time.time() - h.started:.0f} s)", flush=True)
    h.execute(record)
    recorded = record(h.rows)
    text = table(recorded["checks"], header_of(recorded))
    print("\n" + text + f"\nwrote {md_path} and {json_path}")
    left = [r for r in recorded["checks"] if r["verdict"] in (NOT_RUN_BUDGET, NOT_REACHED, INTERRUPTED)]
    if left:
        print(f"{len(left)} check(s) not run for the budget: --resume-from {json_path} runs them (and what failed)")
    if args.keep:
        print(f"the runs' logs and results: {h.work}")
    else:
        shutil.rmtree(h.work, ignore_errors=True)
    return verdict_exit(recorded["checks"])


def header_of(recorded):
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(recorded.get("finished_at", 0)))
    where = recorded.get("gpu") or "the CPU"
    budget = f" (budget {recorded['budget']:.0f} s)" if recorded.get("budget") else ""
    header = f"gpu-check on {where} ({recorded.get('gpus', 0)} GPU(s)), {when}, commit {recorded.get('commit', '?')}, {recorded.get('seconds', '?')} s{budget}"
    resumed = recorded.get("resumed_from")
    if resumed:
        header += f", resuming the run of commit {resumed.get('commit', '?')}"
    if recorded.get("note"):
        header += f"\n\n{recorded['note']}"
    return header


def git_commit():
    """The commit the binaries were built from: the bundle's COMMIT file, else the checkout's."""
    stamp = os.path.join(ROOT, "COMMIT")
    if os.path.exists(stamp):
        return open(stamp).read().strip() or "?"
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
