"""The course tier (`--tier course`): the course's exercises run as the course runs them, on this
GPU, their printouts and charts kept: exercise1 `--device both` with the course's recipe for the
CNN (5 epochs, batch 100, Adam 1e-3), ResNet34 and VGG19 for the course's 5 epochs on the GPU
(their CPU side, which takes the slides 510 s and 2,580 s, for a few steps: its time per step),
exercise1_nlp for the tutorial's 3 epochs on the GPU, why_gpus's CPU and GPU curves, and
exercise2 and `exercise3 ddp` on 2 ranks (sharing the GPU where it has one: --share-gpu).

Each run's printout (the course's rows beside ours), results JSON and charts go into
<results>/course-gpu/ and, for the way back from a node that returns few files, the one archive
<results>/course-gpu.tar.gz; the row gives our figures. The data are generated on the node (it
has no network): CIFAR-10 and WikiText-2 in their real formats, marked GENERATED, so accuracies
and perplexities are not the slides'; the times and the shapes of the printouts are.

On a machine without a GPU (the self-test) the same runs go on the CPU, at sizes it does in
seconds.
"""
import glob
import json
import math
import os
import tarfile
import time

from . import output
from .harness import CheckFailed
from .table import PASS
from .tiers import COURSE
from .multirank import Ranks

FOLDER = "course-gpu"


def keep(h, name, run):
    """A run's printout, results and charts into <results>/course-gpu/<name>/ (folders this tier
    names itself: a link at either name is refused, never written through)."""
    out = output.folder(os.path.join(output.folder(os.path.join(h.args.results, FOLDER)), name))
    output.write(os.path.join(out, "stdout.txt"), " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(run["command"])) + "\n\n" + run["stdout"])
    for path in glob.glob(os.path.join(run["dir"], "*")):
        if path.endswith((".json", ".svg", ".csv")) and not path.endswith(".config.json"):
            output.copy(path, os.path.join(out, os.path.basename(path)))
    archive(h)


def archive(h):
    """<results>/course-gpu.tar.gz of everything kept so far, with where and when it ran
    (rewritten after each run, whole or not at all)."""
    folder = output.folder(os.path.join(h.args.results, FOLDER))
    output.write(os.path.join(folder, "RUN.txt"), f"The course tier of bench/gpu_check.py on {h.gpu_name or 'the CPU (its self-test)'}, commit {h.commit}, "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; generated data (CIFAR-10, WikiText-2 formats).\n")
    path = os.path.join(h.args.results, f"{FOLDER}.tar.gz")
    with output.replacing(path, "wb") as f, tarfile.open(path, "w:gz", fileobj=f) as tar:
        tar.add(folder, arcname=FOLDER)


def figures(run):
    """Our figures per device from a run's results (one JSON per device with --device both)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(run["dir"], "*.json"))):
        if path.endswith((".config.json", ".memory-estimate.json", "trace.json")):
            continue
        with open(path) as f:
            data = json.load(f)
        if data.get("throughput_unit") == "tokens/s":
            metric = f"test loss {data['test_loss']:.4f} (ppl {math.exp(min(data['test_loss'], 50)):,.1f})"
        else:
            metric = f"test acc {data['test_acc']:.4f}, test loss {data['test_loss']:.4f}"
        rows.append(f"{data['device']}: {data['steps']} steps in {data['train_time_s']:.1f} s, {metric}")
    if not rows:
        raise CheckFailed("the run wrote no results")
    return "; ".join(rows)


def plan(h):
    ranks = Ranks(h)
    gpu = not h.cpu
    both = "both" if gpu else "cpu"
    # The CPU self-test: the same runs at sizes a CPU does in seconds.
    quick = [] if gpu else ["--max-steps", "3", "--batch-size", "10"]

    def exercise1(model, device):
        def body():
            # The GPU side on a whole CIFAR-10 (its 10,000 test images evaluated after each epoch);
            # the self-test on the small one.
            data = h.cifar_full() if gpu else h.cifar_tiny
            run = h.run(f"course-e1-{model}", "exercise1", ["--model", model, "--recipe", "course", "--device", device, "--data-dir", data, *quick])
            keep(h, f"exercise1-{model}", run)
            return PASS, figures(run)
        return body

    h.check("course: exercise1 --device both, the CNN, the course's recipe (5 epochs, batch 100, Adam 1e-3)", exercise1("cnn", both), COURSE, (70, 10))
    # The course's CPU side for these (the slides: 510 s and 2,580 s for 5 epochs) would take the
    # whole tier: the GPU side as the course runs it; our tables print the slides' CPU rows.
    for model in ["resnet34", "vgg19"]:
        h.check(f"course: exercise1 {model}, the course's 5 epochs on the GPU", exercise1(model, "cuda" if gpu else "cpu"), COURSE, (35, 15))

    def nlp():
        flags = ["--recipe", "course", "--device", "cuda" if gpu else "cpu", "--data-dir", h.wikitext] + ([] if gpu else ["--max-steps", "3", "--emsize", "64",
                                                                                                                        "--d-hid", "64", "--nlayers", "1"])
        run = h.run("course-nlp", "exercise1_nlp", flags)
        keep(h, "exercise1_nlp", run)
        return PASS, figures(run)
    h.check("course: exercise1_nlp, the tutorial's 3 epochs on the GPU", nlp, COURSE, (75, 20))

    def why_gpus():
        flags = ["--device", both] + ([] if gpu else ["--max-side", "256", "--max-scalars", "1000"])
        run = h.run("course-why-gpus", "why_gpus", flags, quiet=False)  # (its printout is the point)
        keep(h, "why_gpus", run)
        svg = glob.glob(os.path.join(run["dir"], "*.svg"))
        if not svg:
            raise CheckFailed("why_gpus drew no chart")
        return PASS, f"{len(run['stdout'].splitlines())} lines of table, {len(svg)} chart(s)"
    h.check("course: why_gpus, scalar and matrix multiplication on the CPU and the GPU", why_gpus, COURSE, (20, 10))

    def data_parallel(binary, sub, model):
        def body():
            steps = ["--max-steps", "100"] if gpu else quick
            data = h.cifar_full() if gpu else h.cifar_tiny
            run = ranks.run(f"course-{binary}-{'-'.join(sub) or 'main'}", binary, [*sub, "--model", model, "--recipe", "course", "--data-dir", data,
                                                                                    "--course-log", "20", *steps], 2, checkpoint=False)
            keep(h, f"{binary}{'-' + '-'.join(sub) if sub else ''}", run)
            return ranks.verdict(), f"{figures(run)}; {ranks.over(2)}"
        return body
    h.check("course: exercise2 (Horovod) on 2 ranks, the course's ResNet34, 100 steps with the course's printout", data_parallel("exercise2", [], "resnet34"),
            COURSE, (40, 20), ranks.needs(2))
    h.check("course: exercise3 ddp on 2 ranks, the course's VGG19, 100 steps with the course's printout", data_parallel("exercise3", ["ddp"], "vgg19"), COURSE,
            (55, 30), ranks.needs(2))

    def pipe():
        devices = "cuda:0,cuda:0" if gpu else "cpu,cpu"
        # (It writes no results folder: its printout is the point.)
        out = output.folder(os.path.join(h.work, "course-pipe"))
        command = [os.path.join(h.bin, "exercise3"), "pipe", "--devices", devices]
        run = h.record("course-pipe", out, command, *h.spawn(command), True)
        keep(h, "exercise3-pipe", run)
        lines = run["stdout"].splitlines()
        gradients = next((l for l in lines if l.startswith("gradients of")), None)
        if gradients is None or float(gradients.rsplit(" ", 1)[1]) > 1e-5:
            raise CheckFailed(f"the pipelined step's gradients are not the whole batch's: {gradients}")
        return PASS, f"{gradients.split(': ', 1)[1]}; {lines[-1].split('; ', 1)[1]}"
    h.check("course: exercise3 pipe, the slides' Pipe example (Linear(16, 8), Linear(8, 4), chunks 8) against naive model parallelism", pipe, COURSE, (5, 3))
