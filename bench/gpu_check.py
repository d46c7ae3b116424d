#!/usr/bin/env python3
"""`make gpu-check`: every GPU path of the workspace on this machine's GPU(s), in one command,
read in one go: a table of path, verdict, figure and ratio to PyTorch eager, in
results/gpu-check.md and results/gpu-check.json, and an exit status (1 if a check failed).

What it runs (short runs on generated data, sized for minutes on one GPU):
  exercise1 cnn/resnet34/vgg19 in 32, 16-mixed and bf16-mixed; --data-on-device,
  --channels-last, --matmul-precision high, --cuda-graph (cnn and exercise1_nlp), the fused
  against the per-parameter optimizer, a checkpoint and --resume; exercise1_nlp in 32 and
  bf16-mixed; exercise3 pipeline with both stages on one GPU (gpipe, 1f1b, interleaved, and
  16-mixed through the gradient scaler); exercise2, exercise3 ddp, exercise3 tp and --zero 1|2|3
  over NCCL with one rank (and two where there are two GPUs, compared with one); --profile's
  kernels; peak memory against --estimate-memory; and, side by side with PyTorch eager on the
  same GPU (bench/bench.sh: warm caches, A B A B), each exercise's throughput, --cuda-graph's,
  and the 1.4B-parameter model's MFU.

What it checks, beyond "it ran": losses finite and falling; --cuda-graph's losses equal eager's
over the same steps, channels-last's equal the usual layout's, the fused optimizer's equal the
per-parameter one's, a resumed run's equal a straight one's, every pipeline schedule's equal
(to float rounding: cuDNN's kernels are not bitwise repeatable); nothing on stderr but our own
lines (no LibTorch, NCCL or CUDA warnings). Throughput against the goals (every exercise at
least PyTorch's, ResNet34 and VGG19 1.1x, --cuda-graph 1.5x, the 1.4B model 50% MFU) is
"below goal" rather than a failure: a slower path still works.

  make gpu-check                                      # builds, gets data, checks
  TORCH_PYTHON=python3 BIN=/path/to/binaries bench/gpu_check.py   # prebuilt binaries
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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lines on stderr that are not ours: LibTorch's and c10's log lines (glog style), Kineto's,
# Python warnings, NCCL's warnings, CUDA errors, crashes. Our own lines are plain sentences
# ("WARNING: ... GENERATED ...", "warning: ...", "note: ...").
FOREIGN_STDERR = re.compile(
    r"^\[[WEF]\d{4} |^ERROR:\d{4}-|UserWarning|NCCL WARN|^terminate called|Traceback|panicked at|CUDA error|^\s*\d+: 0x[0-9a-f]+"
)

GOALS = {  # (entry, precision, cuda graph): least ratio to PyTorch eager
    ("cnn", "32", False): 1.0, ("resnet34", "32", False): 1.1, ("vgg19", "32", False): 1.1, ("nlp", "32", False): 1.0,
    ("cnn", "bf16-mixed", False): 1.0, ("resnet34", "bf16-mixed", False): 1.1, ("vgg19", "bf16-mixed", False): 1.1,
    ("nlp", "bf16-mixed", False): 1.0, ("cnn", "32", True): 1.5, ("nlp", "32", True): 1.5,
}
MFU_GOAL = 0.50


class Check:
    """One row of the table."""

    def __init__(self, path, verdict, figure="", ratio=None, detail=""):
        self.path, self.verdict, self.figure, self.ratio, self.detail = path, verdict, figure, ratio, detail

    def as_dict(self):
        return {"path": self.path, "verdict": self.verdict, "figure": self.figure, "ratio": self.ratio, "detail": self.detail}


def table(checks, header):
    """The Markdown table of `checks` (dicts), with a closing count line."""
    lines = [header, "", "| path | verdict | figure | ratio to PyTorch |", "|---|---|---|---:|"]
    for c in checks:
        ratio = "" if c.get("ratio") is None else f"{c['ratio']:.2f}x"
        figure = c.get("figure", "")
        if c.get("detail") and c["verdict"] == "fail":
            figure = f"{figure}; {c['detail']}" if figure else c["detail"]
        lines.append(f"| {c['path']} | {c['verdict']} | {figure.replace('|', '/')} | {ratio} |")
    counts = {}
    for c in checks:
        counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    lines += ["", ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "no checks"]
    return "\n".join(lines) + "\n"


def verdict_exit(checks):
    return 1 if any(c["verdict"] == "fail" for c in checks) else 0


class Harness:
    def __init__(self, args, device, gpus, gpu_name):
        self.args, self.device, self.gpus, self.gpu_name = args, device, gpus, gpu_name
        self.bin = args.bin
        self.python = args.python
        self.work = tempfile.mkdtemp(prefix="gpu-check-")
        self.checks = []
        self.cpu = device == "cpu"
        self.env = dict(os.environ)
        self.runs = {}

    # ---- running our binaries ---------------------------------------------------------------
    def run(self, key, binary, args, ok=True):
        """Runs `binary args` with its own results folder; returns (results JSON or None, stdout,
        stderr, seconds). Kept under `key` for later comparisons."""
        out = os.path.join(self.work, key)
        os.makedirs(out, exist_ok=True)
        command = [os.path.join(self.bin, binary)] + args + ["--quiet", "--results-dir", out]
        started = time.time()
        proc = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=ROOT)
        seconds = time.time() - started
        with open(os.path.join(out, "command.log"), "w") as f:
            f.write(" ".join(command) + "\n--- stdout\n" + proc.stdout + "\n--- stderr\n" + proc.stderr)
        results = [p for p in glob.glob(os.path.join(out, "*.json")) if not p.endswith(("trace.json", ".memory-estimate.json"))]
        data = json.load(open(results[0])) if len(results) == 1 else None
        run = {"json": data, "stdout": proc.stdout, "stderr": proc.stderr, "seconds": seconds, "code": proc.returncode, "dir": out, "command": command}
        self.runs[key] = run
        if ok and proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise CheckFailed(f"exit {proc.returncode}: {tail}")
        return run

    def add(self, path, verdict, figure="", ratio=None, detail=""):
        check = Check(path, verdict, figure, ratio, detail)
        self.checks.append(check)
        mark = {"pass": "ok", "fail": "FAIL", "below goal": "below goal", "skipped": "skipped"}.get(verdict, verdict)
        print(f"  {mark:10} {path}: {figure}{' (' + detail + ')' if detail and verdict != 'pass' else ''}", flush=True)

    def check(self, path, body):
        """Runs `body()` (returning (verdict, figure[, ratio])) as the check `path`."""
        if self.args.only and not any(o in path for o in self.args.only):
            return
        try:
            result = body()
            verdict, figure = result[0], result[1]
            ratio = result[2] if len(result) > 2 else None
            self.add(path, verdict, figure, ratio)
        except CheckFailed as e:
            self.add(path, "fail", "", None, str(e))
        except Exception as e:  # a bug of the harness is a failed check, not a crash
            self.add(path, "fail", "", None, f"{type(e).__name__}: {e}")

    # ---- what a run shows ---------------------------------------------------------------------
    @staticmethod
    def losses(run):
        losses = (run["json"] or {}).get("step_losses") or []
        if not losses:
            raise CheckFailed("the results have no step_losses")
        return losses

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
        foreign = [line for line in run["stderr"].splitlines() if FOREIGN_STDERR.search(line)]
        if foreign:
            raise CheckFailed(f"foreign lines on stderr: {foreign[0][:160]}")
        throughput = run["json"].get("steady_throughput") or run["json"].get("throughput")
        unit = run["json"].get("throughput_unit", "images/s")
        return f"loss {first:.3f} -> {last:.3f} in {len(losses)} steps, {throughput:,.0f} {unit}"

    @staticmethod
    def same_losses(a, b, tolerance):
        """Largest relative difference of two runs' step losses (over the shorter), or CheckFailed."""
        la, lb = Harness.losses(a), Harness.losses(b)
        n = min(len(la), len(lb))
        worst = max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(la[:n], lb[:n]))
        if not worst <= tolerance:
            raise CheckFailed(f"losses differ by {worst:.2e} (relative) over {n} steps, more than {tolerance:.0e}")
        return f"equal over {n} steps (largest relative difference {worst:.1e})"

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
    def image(self, key, model, precision, extra=(), steps=None):
        steps = steps or ({"cnn": 40, "resnet34": 30, "vgg19": 20}[model] if not self.cpu else 6)
        return self.run(key, "exercise1", ["--device", self.device, "--model", model, "--precision", precision, "--data-dir", self.cifar,
                                           "--max-steps", str(steps), "--epochs", "1", "--seed", "7", *extra])

    def nlp(self, key, precision="32", extra=(), steps=None):
        """The course's model (smaller on the CPU), with Adam at 1e-3: the tutorial's SGD at lr 5
        raises the loss over its first steps before it falls."""
        size = ["--emsize", "128", "--d-hid", "256", "--nlayers", "2", "--nhead", "2"] if self.cpu else []
        return self.run(key, "exercise1_nlp", ["--device", self.device, "--precision", precision, "--data-dir", self.wikitext, "--optimizer", "adam",
                                               "--lr", "1e-3", "--max-steps", str(steps or (8 if self.cpu else 40)), "--epochs", "1", "--seed", "7", *size, *extra])

    def exercise1_checks(self):
        precisions = ["32", "bf16-mixed"] if self.cpu else ["32", "16-mixed", "bf16-mixed"]
        models = ["cnn"] if self.cpu else ["cnn", "resnet34", "vgg19"]
        for model in models:
            for precision in precisions:
                self.check(f"exercise1 {model} {precision}", lambda m=model, p=precision: ("pass", self.healthy(self.image(f"e1-{m}-{p}", m, p))))
        self.check("exercise1 cnn --data-on-device", lambda: ("pass", self.healthy(self.image("e1-cnn-resident", "cnn", "32", ["--data-on-device"]))))
        self.check("exercise1 cnn --matmul-precision high", lambda: ("pass", self.healthy(self.image("e1-cnn-tf32", "cnn", "32", ["--matmul-precision", "high"]))))
        layout_model = "cnn" if self.cpu else "resnet34"

        def channels_last():
            run = self.image(f"e1-{layout_model}-cl", layout_model, "32", ["--channels-last"])
            base = self.runs.get(f"e1-{layout_model}-32") or self.image(f"e1-{layout_model}-32", layout_model, "32")
            return "pass", self.healthy(run) + "; " + self.same_losses(run, base, 2e-3)
        self.check(f"exercise1 {layout_model} --channels-last: the same model", channels_last)

        def optimizer_kernels():
            fused = self.image("e1-cnn-fused", "cnn", "32", ["--optimizer-kernel", "fused"])
            single = self.image("e1-cnn-per-parameter", "cnn", "32", ["--optimizer-kernel", "per-parameter"])
            return "pass", self.same_losses(fused, single, 1e-3)
        self.check("exercise1 cnn Adam: fused kernel = per-parameter", optimizer_kernels)

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
            return "pass", f"epoch 2 after --resume = straight (largest relative difference {worst:.1e})"
        self.check("exercise1 checkpoint + --resume", resume)

        if not self.cpu:
            def graphed():
                run = self.image("e1-cnn-graph", "cnn", "32", ["--cuda-graph"])
                base = self.runs.get("e1-cnn-32") or self.image("e1-cnn-32", "cnn", "32")
                return "pass", self.healthy(run) + "; " + self.same_losses(run, base, 2e-3)
            self.check("exercise1 cnn --cuda-graph = eager", graphed)

    def image_file_checks(self):
        """The JSC exercise: ResNet50 from JPEG files (ImageNet's sizes), decoded on every core, at
        batch 256 in bf16 channels-last on a GPU. The loader keeps up when the steady throughput
        from the files is at least 95% of the same model's fed from memory (CIFAR-10 resized to
        224 on the GPU): that is a data wait under 5% of the step. (On the CPU: batch 4 at 32×32.)"""
        batch, steps, side = (4, 3, 32) if self.cpu else (256, 24, 224)
        fast = [] if self.cpu else ["--precision", "bf16-mixed", "--channels-last"]
        common = ["--device", self.device, "--model", "resnet50", "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--epochs", "1", "--seed", "7", *fast]

        def keeps_up():
            photos = os.path.join(self.work, "photos")
            subprocess.run([os.path.join(self.bin, "prepare_data"), "generate-images", "--out", photos, "--classes", "10", "--train", str(-(-batch * steps // 10) + 2), "--val", "1"],
                           check=True, capture_output=True, env=self.env)
            files = self.run("r50-files", "exercise1", [*common, "--dataset", "imagefolder", "--data-dir", photos])
            memory = self.run("r50-memory", "exercise1", [*common, "--data-dir", self.cifar])
            figure = self.healthy(files, falling=False)
            share = files["json"]["steady_throughput"] / memory["json"]["steady_throughput"]
            wait = files["json"]["data_wait_s"] / files["json"]["train_time_s"]
            verdict = "pass" if share >= 0.95 or self.cpu else "below goal"
            return verdict, f"{figure}; {100 * share:.0f}% of the throughput fed from memory; data wait {100 * wait:.1f}% of training (first batch included)"
        self.check(f"exercise1 resnet50 from JPEG files, batch {batch}{' bf16 channels-last' if fast else ''}: the loader keeps up", keeps_up)

        def against_pytorch():
            """Side by side with PyTorch eager fed by torchvision's DataLoader(ImageFolder), as many
            worker processes as our loader's threads, the same model, batch and precision (A B A B)."""
            if "r50-files" not in self.runs:
                keeps_up()
            photos = os.path.join(self.work, "photos")
            workers = str(len(os.sched_getaffinity(0)))
            reference = [self.python, os.path.join(ROOT, "bench", "exercise1_reference.py"), "--model", "resnet50", "--loader", "imagefolder", "--data-dir", photos,
                         "--device", self.device, "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--workers", workers,
                         "--steady-after", "2"] + (["--precision", "bf16-mixed", "--channels-last"] if fast else [])
            ours, theirs = [], []
            for round in range(self.args.rounds):
                run = self.run(f"r50-files-{round}", "exercise1", [*common, "--dataset", "imagefolder", "--data-dir", photos, "--workers", workers])
                ours.append(run["json"]["steady_throughput"])
                proc = subprocess.run(reference, capture_output=True, text=True, env=self.env, cwd=ROOT)
                if proc.returncode != 0:
                    raise CheckFailed("the PyTorch reference failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
                theirs.append(json.loads(proc.stdout.strip().splitlines()[-1])["steady_throughput"])
            a, b = sorted(ours)[len(ours) // 2], sorted(theirs)[len(theirs) // 2]
            return ("pass" if a >= b else "below goal"), f"{a:,.0f} vs {b:,.0f} images/s (goal 1.0x)", a / b
        if not self.args.no_timings:
            self.check(f"timing exercise1 resnet50 from JPEG files, batch {batch}{' bf16 channels-last' if fast else ''}: against PyTorch + torchvision's DataLoader", against_pytorch)

    def nlp_checks(self):
        for precision in ["32", "bf16-mixed"]:
            self.check(f"exercise1_nlp {precision}", lambda p=precision: ("pass", self.healthy(self.nlp(f"nlp-{p}", p))))
        if not self.cpu:
            def graphed():
                run = self.nlp("nlp-graph", "32", ["--cuda-graph"])
                base = self.runs.get("nlp-32") or self.nlp("nlp-32")
                return "pass", self.healthy(run) + "; " + self.same_losses(run, base, 2e-3)
            self.check("exercise1_nlp --cuda-graph = eager", graphed)

    def pipeline_checks(self):
        gpu = "cpu" if self.cpu else "cuda:0"
        flags = ["--devices", f"{gpu},{gpu}", "--data-dir", self.wikitext, "--emsize", "256", "--d-hid", "512", "--nhead", "4", "--nlayers", "4",
                 "--chunks", "4", "--batch-size", "16", "--max-steps", str(6 if self.cpu else 30), "--epochs", "1", "--seed", "7"]
        runs = {}
        for schedule in ["gpipe", "1f1b", "interleaved"]:
            def one(s=schedule):
                runs[s] = self.run(f"pp-{s}", "exercise3", ["pipeline", *flags, "--schedule", s])
                figure = self.healthy(runs[s])
                if s != "gpipe" and "gpipe" in runs:
                    figure += "; " + self.same_losses(runs[s], runs["gpipe"], 2e-3) + " with gpipe"
                return "pass", figure
            self.check(f"exercise3 pipeline {schedule}, both stages on {gpu}", one)
        if not self.cpu:
            self.check("exercise3 pipeline gpipe 16-mixed (gradient scaler)", lambda: ("pass", self.healthy(self.run("pp-fp16", "exercise3", ["pipeline", *flags, "--precision", "16-mixed"]))))

    def nccl_checks(self):
        if self.cpu:
            return
        ranks = [1] + ([2] if self.gpus >= 2 else [])
        for n in ranks:
            common = ["--nproc-per-node", str(n), "--backend", "nccl", "--device", "cuda", "--seed", "7"]
            self.check(f"exercise2 (Horovod style) over NCCL, {n} rank(s)", lambda c=common, n=n: ("pass", self.healthy(self.run(f"e2-{n}", "exercise2", c + ["--data-dir", self.cifar, "--max-steps", "30", "--epochs", "1"]))))
            self.check(f"exercise3 ddp over NCCL, {n} rank(s)", lambda c=common, n=n: ("pass", self.healthy(self.run(f"ddp-{n}", "exercise3", ["ddp", *c, "--data-dir", self.cifar, "--max-steps", "20", "--epochs", "1"]))))
            tp_flags = ["tp", *common, "--tp", str(n), "--data-dir", self.wikitext, "--emsize", "256", "--d-hid", "512", "--nhead", "4", "--nlayers", "2", "--pad-vocab", "8", "--max-steps", "30", "--epochs", "1"]
            self.check(f"exercise3 tp over NCCL, {n} rank(s)", lambda f=tp_flags, n=n: ("pass", self.healthy(self.run(f"tp-{n}", "exercise3", f))))
            for zero in [1, 2, 3]:
                flags = [*common, "--zero", str(zero), "--optimizer", "adam", "--lr", "1e-3", "--data-dir", self.wikitext, "--max-steps", "30", "--epochs", "1",
                         "--emsize", "256", "--d-hid", "512", "--nhead", "4", "--nlayers", "2"]
                self.check(f"exercise1_nlp --zero {zero} over NCCL, {n} rank(s)", lambda f=flags, n=n, z=zero: ("pass", self.healthy(self.run(f"zero{z}-{n}", "exercise1_nlp", f))))
        if self.gpus >= 2:
            def two_equal_one(name, a, b):
                return "pass", self.same_losses(self.runs[a], self.runs[b], 2e-3)
            self.check("exercise3 tp: 2 ranks train the model of 1", lambda: two_equal_one("tp", "tp-2", "tp-1"))
            for zero in [1, 2, 3]:
                self.check(f"--zero {zero}: 2 ranks = 1 rank", lambda z=zero: two_equal_one("zero", f"zero{z}-2", f"zero{z}-1"))

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
            return "pass", f"{len(events)} trace events, {kernels} kernels"
        self.check("--profile: LibTorch's profiler, operators and kernels", profile)

        def memory(name, binary, flags):
            estimate_dir = os.path.join(self.work, f"estimate-{name}")
            subprocess.run([os.path.join(self.bin, binary), *flags, "--estimate-memory", "--results-dir", estimate_dir], check=True, capture_output=True, env=self.env, cwd=ROOT)
            estimated = json.load(open(glob.glob(os.path.join(estimate_dir, "*.memory-estimate.json"))[0]))["ranks"][0]["total"]
            run = self.run(f"mem-{name}", binary, [*flags, "--max-steps", "4", "--epochs", "1"])
            peak = run["json"]["peak_memory"][0]
            measured = peak["training_peak_bytes"] - peak["baseline_bytes"]
            ratio = estimated / measured
            figure = f"estimated {estimated / 2**20:,.0f} MiB, measured {measured / 2**20:,.0f} MiB ({100 * (ratio - 1):+.0f}%)"
            if peak.get("peak_reserved_bytes"):
                figure += f", reserved {peak['peak_reserved_bytes'] / 2**20:,.0f} MiB"
            return ("pass" if abs(ratio - 1) <= 0.2 else "below goal"), figure
        size = ["--emsize", "128", "--d-hid", "256", "--nlayers", "2", "--nhead", "2"] if self.cpu else []
        common = ["--device", self.device, "--data-dir", self.wikitext, *size]
        self.check("peak memory vs --estimate-memory: exercise1_nlp 32", lambda: memory("nlp-32", "exercise1_nlp", common))
        self.check("peak memory vs --estimate-memory: exercise1_nlp bf16-mixed", lambda: memory("nlp-bf16", "exercise1_nlp", [*common, "--precision", "bf16-mixed"]))

    def big_model_checks(self):
        """The 1.4B-parameter Transformer's MFU at a batch that fills the GPU."""
        if self.cpu:
            return
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
                return "skipped", figure + "; no known peak for this GPU (give --peak-tflops)"
            mfu = data["flops_per_example"] * steady / 1e12 / peak
            return ("pass" if mfu >= MFU_GOAL else "below goal"), f"{figure}; MFU {100 * mfu:.1f}% of {peak:.0f} TFLOP/s (goal {100 * MFU_GOAL:.0f}%)"
        self.check("1.4B Transformer bf16-mixed, 16 x 512 tokens: MFU", mfu)

    def timing_checks(self):
        """Side by side with PyTorch eager through bench/bench.sh (warm caches, A B A B)."""
        if self.args.no_timings:
            return
        plans = [("32", False, "cnn resnet34 vgg19 nlp"), ("bf16-mixed", False, "cnn resnet34 vgg19 nlp"), ("32", True, "cnn nlp")]
        if self.cpu:
            plans = [("32", False, "cnn")]
        # The timings read a whole-sized CIFAR-10 (a generated one: the figures are throughput).
        full = os.path.join(self.work, "cifar10-full")
        if not os.path.isdir(full):
            subprocess.run([os.path.join(self.bin, "prepare_data"), "generate", "--dataset", "cifar10", "--out", full], check=True, capture_output=True, env=self.env)
        for precision, graph, entries in plans:
            csv_path = os.path.join(self.work, f"bench-{precision}-{graph}.csv")
            env = dict(self.env, DEVICE=self.device, PRECISION=precision, BENCH=entries, ROUNDS=str(self.args.rounds), PEERS="", BIN=self.bin,
                       BENCH_CSV=csv_path, CUDA_GRAPH="1" if graph else "0", TORCH_PYTHON=self.python, CIFAR_DIR=full, WIKITEXT_DIR=self.wikitext,
                       CNN_STEPS="30" if not self.cpu else "4", RESNET34_STEPS="15", VGG19_STEPS="10", NLP_STEPS="15", MIN_SECONDS="2" if not self.cpu else "0.2",
                       BENCH_NOTE="gpu-check")
            label = f"{precision}{' --cuda-graph' if graph else ''}"
            if self.args.only and not any(o in f"timing {label}" for o in self.args.only):
                continue
            proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "bench.sh")], capture_output=True, text=True, env=env, cwd=ROOT)
            open(os.path.join(self.work, f"bench-{precision}-{graph}.log"), "w").write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                self.add(f"timing {label}: {entries}", "fail", "", None, (proc.stderr.strip().splitlines() or ["bench.sh failed"])[-1])
                continue
            import csv
            for row in csv.DictReader(open(csv_path)):
                entry = row["model"] if row["exercise"] == "exercise1" else "nlp"
                ratio = float(row.get("ratio_rounds_median") or row["ratio"])
                goal = GOALS.get((entry, precision, graph), 1.0)
                figure = f"{float(row['rust_throughput']):,.0f} vs {float(row['pytorch_throughput']):,.0f} {row['unit']} (goal {goal:.1f}x)"
                self.add(f"timing {'exercise1 ' + entry if entry != 'nlp' else 'exercise1_nlp'} {label}", "pass" if ratio >= goal else "below goal", figure, ratio)


class CheckFailed(Exception):
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("BIN", os.path.join(ROOT, "target", "release")), help="where the binaries are (BIN)")
    p.add_argument("--python", default=os.environ.get("TORCH_PYTHON", sys.executable), help="a Python with PyTorch 2.11 (TORCH_PYTHON)")
    p.add_argument("--results", default=os.path.join(ROOT, "results"), help="where gpu-check.json and gpu-check.md go")
    p.add_argument("--table", metavar="JSON", help="print the table of a recorded check and exit with its verdict")
    p.add_argument("--only", action="append", help="run only the checks whose path contains this (repeatable)")
    p.add_argument("--no-timings", action="store_true", help="skip the side-by-side timings against PyTorch")
    p.add_argument("--rounds", type=int, default=1, help="A/B rounds of each timing (bench.sh's ROUNDS)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the harness's own test, the checks that need no CUDA, tiny")
    p.add_argument("--keep", action="store_true", help="keep the runs' folder (logs, results)")
    args = p.parse_args()

    if args.table:
        try:
            recorded = json.load(open(args.table))
        except (OSError, ValueError) as e:
            print(f"gpu-check: cannot read the recorded check {args.table}: {e}", file=sys.stderr)
            return 2
        print(table(recorded["checks"], header_of(recorded)), end="")
        return verdict_exit(recorded["checks"])

    gpus, name = detect_gpus(args.python)
    if args.device == "cuda" and gpus == 0:
        why = f"{args.python}: " + (name if name.startswith("(") else "torch.cuda.is_available() is False")
        print(f"gpu-check: no CUDA GPU on this machine ({why}); run it on a GPU node", file=sys.stderr)
        return 2
    missing = [b for b in ("exercise1", "exercise1_nlp", "exercise2", "exercise3", "prepare_data") if not os.access(os.path.join(args.bin, b), os.X_OK)]
    if missing:
        print(f"gpu-check: no {', '.join(missing)} in {args.bin}: build them (make build) or point BIN at the prebuilt binaries", file=sys.stderr)
        return 2

    h = Harness(args, args.device, gpus, name)
    started = time.time()
    print(f"gpu-check on {name or 'the CPU'} ({gpus} GPU(s)), binaries in {args.bin}; runs in {h.work}", flush=True)
    h.prepare_data()
    for group in (h.exercise1_checks, h.image_file_checks, h.nlp_checks, h.pipeline_checks, h.nccl_checks, h.profile_and_memory_checks, h.big_model_checks, h.timing_checks):
        group()
    recorded = {
        "finished_at": int(time.time()), "seconds": round(time.time() - started), "device": args.device, "gpu": name, "gpus": gpus,
        "torch_python": args.python, "binaries": args.bin, "commit": git_commit(), "checks": [c.as_dict() for c in h.checks],
    }
    os.makedirs(args.results, exist_ok=True)
    stem = "gpu-check" if args.device == "cuda" else "gpu-check-cpu"
    json_path, md_path = os.path.join(args.results, f"{stem}.json"), os.path.join(args.results, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump(recorded, f, indent=2)
        f.write("\n")
    text = table(recorded["checks"], header_of(recorded))
    with open(md_path, "w") as f:
        f.write(text)
    print("\n" + text + f"\nwrote {md_path} and {json_path}")
    if args.keep:
        print(f"the runs' logs and results: {h.work}")
    else:
        shutil.rmtree(h.work, ignore_errors=True)
    return verdict_exit(recorded["checks"])


def header_of(recorded):
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(recorded.get("finished_at", 0)))
    where = recorded.get("gpu") or "the CPU"
    return f"gpu-check on {where} ({recorded.get('gpus', 0)} GPU(s)), {when}, commit {recorded.get('commit', '?')}, {recorded.get('seconds', '?')} s"


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
