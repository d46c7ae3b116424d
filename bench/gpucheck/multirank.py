"""Tier 1, first: the multi-rank paths, each an equality against one rank (data parallelism at
twice the per-rank batch, ZeRO 1/2/3, HSDP, tensor and sequence parallelism, the pipeline across
processes in each schedule, TP × PP, a sharded checkpoint resumed at other world sizes, float16
gradients, the parameter server, a torchrun-style launch), and the collective watchdog.

On a GPU the ranks talk over NCCL. Where a row has more ranks than the machine has GPUs, they
share one (`--share-gpu`: each rank an NCCL host of its own, NCCL's socket transport on
loopback, their kernels taking turns: a check, not a speed). If NCCL refuses even so, the row
says why and the rows fall back to `--backend mpi` with CUDA tensors staged through the host,
so that the CUDA side of the multi-rank code still runs. A GPU in an exclusive compute mode
admits one process at a time: the rows that need several then say so and do not run. On the
CPU (the bundle's self-test) the same rows run over MPI.

What "equal" means here: the same optimizer steps, the same epoch training losses (every
replica's mean) and the same trained parameters (the whole-model checkpoints, each tensor's
relative difference ‖a − b‖ / ‖a‖), to BOUND, which is what adding the same float32 numbers in
another order allows over a few steps at a constant rate (SGD, no dropout, no warm-up; on a GPU
with --deterministic kernels and no TF32). The steps are few on purpose: a ReLU whose input is
within rounding of 0 may fall on either side in the two runs, and the longer they go the more
such tokens' gradients part.
"""
import os
import re
import shutil
import socket
import subprocess
import time

from . import output
from .harness import CheckFailed, tail
from .table import PASS, BELOW
from .tiers import MULTIRANK

# Relative bound on losses and parameters (‖a − b‖ / ‖a‖ per tensor) of two runs that add in
# another order (harness.same_parameters says why the norm).
BOUND = {"cpu": 1e-4, "cuda": 1e-4}
# float16 gradients round each value to 2^-11 of itself before they are averaged.
FP16_BOUND = 1e-2
# What in a failed run's stderr says that NCCL itself refused (not our code).
NCCL_REFUSED = re.compile(r"ncclCommInitRank failed|NCCL error|Duplicate GPU|ncclInvalidUsage|ncclSystemError|ncclInternalError")


def compute_mode():
    """The GPU's compute mode as nvidia-smi reports it ('Default', 'Exclusive_Process', ...), or
    None where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    modes = out.stdout.split()
    return modes[0] if out.returncode == 0 and modes else None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """How this machine places a row's ranks, and what NCCL has said so far."""

    def __init__(self, h):
        self.h = h
        self.refused = None  # NCCL's refusal, once one row has seen it: the later rows go over MPI
        self.mode = None if h.cpu else compute_mode()

    def needs(self, ranks):
        """Why `ranks` processes cannot run here (None: they can)."""
        if not self.h.cpu and ranks > max(self.h.gpus, 1) and self.mode not in (None, "Default"):
            return f"a GPU in the Default compute mode for {ranks} processes (this one is {self.mode}: one process at a time)"
        return None

    def backend(self, mpi=False):
        return "mpi" if self.h.cpu or mpi or self.refused else "nccl"

    def flags(self, ranks, mpi=False):
        """The flags that start `ranks` local ranks here."""
        flags = ["--device", self.h.device, "--nproc-per-node", str(ranks), "--backend", self.backend(mpi)]
        if not self.h.cpu and ranks > self.h.gpus:
            flags.append("--share-gpu")
        return flags

    def over(self, ranks, mpi=False):
        """The row's words for where the ranks' collectives ran."""
        if self.h.cpu:
            return "over MPI (CPU ranks)"
        shared = f", {ranks} ranks sharing {self.h.gpus} GPU(s)" if ranks > self.h.gpus else ""
        if self.refused:
            return f"over MPI, CUDA tensors staged through the host (NCCL refused: {self.refused}){shared}"
        if mpi:
            return f"over MPI, CUDA tensors staged through the host{shared}"
        return f"over NCCL{shared}"

    def run(self, key, binary, args, ranks, mpi=False, checkpoint=True, env=None):
        """`binary args` on `ranks` ranks; where NCCL refuses, again over MPI (and so the rest)."""
        run = self.h.run(key, binary, [*args, *self.flags(ranks, mpi)], ok=False, env=env, checkpoint=checkpoint)
        if run["code"] != 0 and not self.h.cpu and not mpi and not self.refused and NCCL_REFUSED.search(run["stderr"]):
            self.refused = tail(run["stderr"])[:200]
            run = self.h.run(key + "-mpi", binary, [*args, *self.flags(ranks, mpi)], ok=False, env=env, checkpoint=checkpoint)
        if run["code"] != 0:
            raise CheckFailed(f"exit {run['code']}: {tail(run['stderr'], 3)}")
        self.h.foreign(run)
        return run

    def verdict(self, mpi=False):
        """A row that held, but over MPI because NCCL refused, is below its goal (over NCCL)."""
        return BELOW if self.refused and not mpi else PASS


def plan(h):
    """The rows. Their estimates (seconds on an H200, on the CPU) are counted from the runs each
    makes, at 4-7 s a run on the GPU (start-up, CUDA's and NCCL's set-up, a few steps) as the
    1-rank rows of 2026-11-28 took; none has been measured yet."""
    ranks = Ranks(h)
    bound = BOUND[h.device]
    gpu = not h.cpu
    exact = ["--deterministic"] if gpu else ["--threads", "1"]

    # ---- images: exercise2 (Horovod's way) and exercise3 ddp (PyTorch DDP's) -------------------
    # 200 images: an epoch is 5 steps of 40 on one rank, 5 of 2 × 20 on two; 2 epochs.
    image = ["--model", "cnn", "--data-dir", h.cifar_tiny, "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--epochs", "2", "--seed", "7", *exact]

    def one_image_rank(binary, sub):
        key = f"one-{binary}-{'-'.join(sub) or 'main'}"
        return h.cached(key, lambda: h.run(key, binary, [*sub, *image, "--device", h.device, "--batch-size", "40"], checkpoint=True))

    def replicas_agree(run, n):
        if f"parameters bit-identical on all {n} ranks" not in run["stdout"]:
            raise CheckFailed(f"no 'parameters bit-identical on all {n} ranks' line: the replicas were not compared, or differ")

    def image_equality(binary, sub, extra=(), row_bound=None, mpi=False):
        def body():
            two = ranks.run(f"two-{binary}-{'-'.join(sub) or 'main'}{'-'.join(extra)}", binary, [*sub, *image, "--batch-size", "20", *extra], 2, mpi)
            replicas_agree(two, 2)
            one = one_image_rank(binary, sub)
            return ranks.verdict(mpi), h.same_training(two, one, row_bound or bound, f"2 ranks x 20 {ranks.over(2, mpi)} = 1 rank x 40")
        return body

    need2 = ranks.needs(2)
    h.check("exercise2 (Horovod style): 2 ranks x 20 = 1 rank x 40", image_equality("exercise2", []), MULTIRANK, (14, 12), need2)
    h.check("exercise3 ddp (PyTorch DDP style): 2 ranks x 20 = 1 rank x 40", image_equality("exercise3", ["ddp"]), MULTIRANK, (14, 12), need2)
    h.check("exercise2 --fp16-allreduce: 2 ranks x 20 = 1 rank x 40 within float16's rounding",
            image_equality("exercise2", [], ["--fp16-allreduce"], FP16_BOUND), MULTIRANK, (8, 8),
            "NCCL (MPI has no float16 reduction)" if h.cpu else need2)

    def parameter_server():
        # 2 workers (on the GPU) and 1 server (on the CPU, running the optimizer), synchronous:
        # the servers apply the average of both workers' gradients, all-reduce's model.
        run = ranks.run("ps-sync-2", "exercise2", [*image, "--batch-size", "20", "--strategy", "parameter-server", "--sync"], 3)
        one = one_image_rank("exercise2", [])
        where = "2 workers on the CPU" if h.cpu else f"2 workers on {h.gpus} GPU(s)"
        return ranks.verdict(), h.same_training(run, one, bound, f"{where} and 1 server on the CPU, synchronous, {ranks.over(2)} = 1 rank x 40")
    h.check("exercise2 --strategy parameter-server --sync: 2 workers x 20 and a server = 1 rank x 40", parameter_server, MULTIRANK, (10, 10), ranks.needs(2))

    # ---- the language model: data parallelism, ZeRO, HSDP, tensor and sequence parallelism ----
    size = ["--emsize", "32", "--d-hid", "64", "--nhead", "4"] if h.cpu else ["--emsize", "256", "--d-hid", "512", "--nhead", "4"]
    # SGD at a constant rate, without exercise3's warm-up, in small steps: where a step moves the
    # model far, rounding's differences grow from step to step (measured on the CPU: exercise3's
    # model at lr 0.5 unclipped, 1 in 1,000 after 4 steps; in small steps, 2e-7). exercise1_nlp
    # unclipped at lr 0.2 (an averaging that sums, or drops a rank, moves it elsewhere); exercise3
    # clipped at 0.002, below its gradient's norm (about 0.007) at every step, so that the norm of
    # the whole model's gradient, summed over shards and stages, sets each step. Windows of 32
    # tokens, which 2 and 4 sequence shards divide.
    common_recipe = ["--optimizer", "sgd", "--momentum", "0", "--lr-schedule", "constant", "--warmup-steps", "0", "--dropout", "0", "--bptt", "32",
                     "--pad-vocab", "8", "--max-steps", "4", "--epochs", "1", "--seed", "7", *exact]
    recipes = {"exercise1_nlp": ["--lr", "0.2", "--clip", "0"], "exercise3": ["--lr", "0.5", "--clip", "0.002"]}

    def lm(layers=2, binary="exercise1_nlp"):
        return ["--data-dir", h.wikitext, *size, "--nlayers", str(layers), *common_recipe, *recipes[binary]]

    def one_lm(key, binary, sub, extra, layers=2):
        return h.cached(key, lambda: h.run(key, binary, [*sub, *lm(layers, binary), "--device", h.device, *extra], checkpoint=True))

    # Two models: without --tp (the exercise's own layers) and with it (the tensor-parallel
    # layers, initialised in their own order): each layout is held to the one it trains.
    def whole():
        return one_lm("one-lm", "exercise1_nlp", [], ["--batch-size", "8"])

    def whole_tp():
        return one_lm("one-lm-tp", "exercise1_nlp", [], ["--batch-size", "8", "--tp", "1"])

    def lm_equality(key, n, extra, baseline, what, mpi=False, agree=None):
        def body():
            run = ranks.run(key, "exercise1_nlp", [*lm(), *extra], n, mpi)
            if agree:
                replicas_agree(run, agree)
            return ranks.verdict(mpi), h.same_training(run, baseline(), bound, f"{what} {ranks.over(n, mpi)}")
        return body

    h.check("exercise1_nlp data parallel: 2 ranks x 4 = 1 rank x 8", lm_equality("lm-dp2", 2, ["--batch-size", "4"], whole, "2 ranks x 4 = 1 rank x 8", agree=2),
            MULTIRANK, (10, 8), need2)
    for zero in [1, 2, 3]:
        h.check(f"exercise1_nlp --zero {zero}: 2 ranks x 4 = 1 rank x 8",
                lm_equality(f"lm-zero{zero}", 2, ["--batch-size", "4", "--zero", str(zero)], whole, f"ZeRO-{zero}, 2 ranks x 4 = 1 rank x 8", agree=2),
                MULTIRANK, (8, 8), need2)
    h.check("exercise1_nlp HSDP (--zero 3 --shard-group 2): 4 ranks x 2 = 1 rank x 8",
            lm_equality("lm-hsdp", 4, ["--batch-size", "2", "--zero", "3", "--shard-group", "2"], whole, "ZeRO-3 in 2 groups of 2, 4 ranks x 2 = 1 rank x 8"),
            MULTIRANK, (12, 12), ranks.needs(4))
    h.check("exercise1_nlp --tp 2: 2 shards = 1 rank", lm_equality("lm-tp2", 2, ["--batch-size", "8", "--tp", "2"], whole_tp, "2 tensor-parallel shards = --tp 1"),
            MULTIRANK, (10, 8), need2)
    h.check("exercise1_nlp --tp 2 --sequence-parallel: 2 shards = 1 rank",
            lm_equality("lm-sp2", 2, ["--batch-size", "8", "--tp", "2", "--sequence-parallel"], whole_tp, "2 shards with sequence parallelism = --tp 1"),
            MULTIRANK, (8, 8), need2)

    # ---- pipelines across processes, and TP x PP ---------------------------------------------
    # 4 layers: 2 stages of 2 virtual stages of one layer each for the interleaved schedule.
    staged = ["--batch-size", "8", "--chunks", "4"]

    def one_process_pipeline():
        on = h.one_gpu()
        return one_lm("one-pipeline", "exercise3", ["pipeline"], [*staged, "--devices", f"{on},{on}"], layers=4)

    def pipeline_row(schedule):
        extra = ["--schedule", schedule] + (["--virtual-stages", "2"] if schedule == "interleaved" else [])
        # NCCL's sends complete only once received and go out with the sender's next receive,
        # which the interleaved order cannot wait for (exercise3 refuses it): it runs over MPI.
        mpi = schedule == "interleaved"

        def body():
            run = ranks.run(f"pp2-{schedule}", "exercise3", ["pipeline", *lm(4, "exercise3"), *staged, *extra], 2, mpi)
            return ranks.verdict(mpi), h.same_training(run, one_process_pipeline(), bound, f"2 stage processes, {schedule}, {ranks.over(2, mpi)} = one process")
        return body
    for schedule in ["gpipe", "1f1b", "interleaved"]:
        h.check(f"exercise3 pipeline {schedule} across 2 processes = one process", pipeline_row(schedule), MULTIRANK, (8, 8), need2)

    def tp_times_pp():
        run = ranks.run("tp2-pp2", "exercise3", ["tp", *lm(4, "exercise3"), *staged, "--tp", "2", "--pp", "2"], 4)
        one = one_lm("one-tp", "exercise3", ["tp"], staged, layers=4)
        return ranks.verdict(), h.same_training(run, one, bound, f"TP 2 x PP 2 on 4 ranks {ranks.over(4)} = 1 rank")
    h.check("exercise3 tp --tp 2 --pp 2: 4 ranks = 1 rank", tp_times_pp, MULTIRANK, (14, 14), ranks.needs(4))

    # ---- a sharded checkpoint, resumed on other world sizes ------------------------------------
    def sharded_resume():
        zero3 = [*lm(), "--zero", "3"]
        written = os.path.join(h.work, "sharded")
        straight = ranks.run("sharded-straight", "exercise1_nlp", [*zero3, "--batch-size", "4"], 2)
        ranks.run("sharded-first", "exercise1_nlp", [*zero3, "--batch-size", "4", "--max-steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", written,
                                                     "--checkpoint-format", "sharded"], 2, checkpoint=False)
        shards = [f for f in os.listdir(written)] if os.path.isdir(written) else []
        if not any(f.endswith(".shards") for f in shards):
            raise CheckFailed(f"no sharded checkpoint (<run>.shards/) in {written}: {shards or 'no folder'}")
        lines = []
        for n, batch in [(1, "8"), (4, "2")]:
            folder = os.path.join(h.work, f"sharded-on-{n}")
            output.check_folder(folder)  # (copytree itself refuses any name already there)
            shutil.copytree(written, folder)
            flags = [*zero3, "--batch-size", batch, "--resume", "--checkpoint-dir", folder, "--checkpoint-format", "whole"]
            if n == 1:
                resumed = h.run("sharded-resumed-1", "exercise1_nlp", [*flags, "--device", h.device])
            else:
                resumed = ranks.run(f"sharded-resumed-{n}", "exercise1_nlp", flags, n, checkpoint=False)
            if "resumed" not in resumed["stdout"] or resumed["json"]["steps"] != 2:
                raise CheckFailed(f"the run on {n} rank(s) did not resume at step 2 ({resumed['json']['steps']} steps): {tail(resumed['stdout'])}")
            resumed["checkpoint_dir"] = folder
            worst, _ = h.same_parameters(resumed, straight, bound)
            lines.append(f"on {n} rank(s) {worst:.1e}")
        return ranks.verdict(), (f"written by 2 ZeRO-3 ranks {ranks.over(2)} at step 2 of 4, resumed; the parameters at step 4 against a straight run: "
                                 f"{', '.join(lines)} (relative norm; bound {bound:.0e})")
    h.check("sharded checkpoint: written by 2 ZeRO-3 ranks, resumed on 1 and on 4 = straight", sharded_resume, MULTIRANK, (28, 30), ranks.needs(4))

    # ---- torchrun's way: RANK, WORLD_SIZE, MASTER_ADDR set by hand, one process each ----------
    def torchrun_style():
        port = str(free_port())
        out = output.folder(os.path.join(h.work, "torchrun"))
        flags = [*lm(), "--batch-size", "4", "--device", "cuda", "--backend", "nccl", "--checkpoint-dir", out, "--checkpoint-format", "whole", "--quiet",
                 "--results-dir", out] + (["--share-gpu"] if h.gpus < 2 else [])
        commands = []
        for rank in range(2):
            env = dict(h.env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            commands.append(([os.path.join(h.bin, "exercise1_nlp"), *flags], env, None))
        done = h.spawn_all(commands)
        for rank, (code, stdout, stderr, seconds) in enumerate(done):
            run = h.record(f"torchrun-{rank}", out, commands[rank][0], code, stdout, stderr, seconds, ok=True)
        run = h.runs["torchrun-0"]
        return PASS, h.same_training(run, whole(), bound, "2 processes started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT), over NCCL = 1 rank x 8")
    h.check("torchrun-style launch: 2 processes x 4 = 1 rank x 8", torchrun_style, MULTIRANK, (8, 0),
            "CUDA (ranks started without MPI have no collectives for CPU tensors)" if h.cpu else need2)

    # ---- the collective watchdog ---------------------------------------------------------------
    # On ZeRO-1's collectives (a reduce-scatter and an all-gather each step).
    watched = [*lm(), "--batch-size", "4", "--zero", "1", "--max-steps", "30" if gpu else "8"]

    def watchdog_quiet():
        run = ranks.run("watch-quiet", "exercise1_nlp", watched + ["--collective-timeout", "20"], 2, checkpoint=False)
        if "--collective-timeout" in run["stderr"]:
            raise CheckFailed("the watchdog fired in a healthy run: " + tail(run["stderr"])[:160])
        return ranks.verdict(), f"{run['json']['steps']} steps {ranks.over(2)}, the watchdog (20 s) stayed quiet"
    h.check("collective watchdog: a healthy 2-rank ZeRO-1 run with --collective-timeout 20 runs through", watchdog_quiet, MULTIRANK, (10, 10), need2)

    def watchdog_fires():
        # Operation 3 of rank 1 never completes for that rank (a test hook): past the timeout the
        # job must end with the watchdog's exit code 3, in one line naming the rank and the
        # operation, within the timeout and 10 s. (A group's first operation waits at least 5
        # minutes, start-up in mind: the stall is put on a later one.)
        timeout = 5
        env = dict(h.env, COURSE_TEST_STALL_COLLECTIVE="1:3")
        started = time.time()
        run = h.run("watch-fires", "exercise1_nlp", watched + ranks.flags(2) + ["--collective-timeout", str(timeout)], ok=False, env=env)
        took = time.time() - started
        line = next((line for line in run["stderr"].splitlines() if "--collective-timeout" in line), None)
        if run["code"] != 3 or line is None:
            raise CheckFailed(f"exit {run['code']} (expected 3, the watchdog's): {tail(run['stderr'])[:160]}")
        if not re.search(r"operation #?\d+", line) or not re.search(r"\brank 1\b", line):
            raise CheckFailed(f"the line does not name the rank and the operation: {line[:160]}")
        waited = re.search(r"waited (\d+) s", line)
        if waited is None or int(waited.group(1)) > timeout + 10:
            raise CheckFailed(f"the job was not ended within the timeout ({timeout} s) and 10 s: {line[:160]}")
        return ranks.verdict(), f"ended in {took:.0f} s (exit 3) {ranks.over(2)}: {line.strip()[:260]}"
    h.check("collective watchdog: a rank whose collective never completes ends the job, naming the rank and the operation", watchdog_fires, MULTIRANK, (18, 15),
            need2)
