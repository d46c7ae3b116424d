"""The machine's own figures. Tier 9: --profile's kernels, each run's peak memory against
--estimate-memory. Tier 10: ResNet50 fed from JPEG files keeping up with the same model fed from
memory; the 1.4B model's MFU; the layout planner's profile of this machine and its plan
against runs."""
import glob
import json
import os
import subprocess

from . import output
from .harness import CheckFailed
from .table import PASS, BELOW, SKIPPED
from .tiers import MACHINE, MEMORY

MFU_GOAL = 0.50


def plan(h):
    profile_and_memory(h)
    image_files(h)
    big_model(h)
    planner(h)


def profile_and_memory(h):
    def profile():
        run = h.image("e1-profile", "cnn", "32", ["--profile-steps", "3..5"], steps=6)
        out = run["stdout"]
        unit = "CPU" if h.cpu else "CUDA"
        if f"operators and kernels by self {unit} time" not in out or "aten::" not in out:
            raise CheckFailed("no operator table in the output")
        trace = glob.glob(os.path.join(run["dir"], "*.torch-trace.json"))
        events = json.load(open(trace[0]))["traceEvents"]
        kernels = sum(1 for e in events if e.get("cat") == "kernel")
        if not h.cpu and kernels == 0:
            raise CheckFailed("the trace has no CUDA kernels")
        return PASS, f"{len(events)} trace events, {kernels} kernels"
    h.check("--profile: LibTorch's profiler, operators and kernels", profile, MEMORY, (15, 6))

    def memory(name, binary, flags):
        estimate_dir = os.path.join(h.work, f"estimate-{name}")
        code, _, err, _ = h.spawn([os.path.join(h.bin, binary), *flags, "--estimate-memory", "--results-dir", estimate_dir])
        if code != 0:
            raise CheckFailed(f"--estimate-memory: exit {code}: {(err.strip().splitlines() or ['?'])[-1]}")
        estimated = json.load(open(glob.glob(os.path.join(estimate_dir, "*.memory-estimate.json"))[0]))["ranks"][0]["total"]
        run = h.run(f"mem-{name}", binary, [*flags, "--max-steps", "4", "--epochs", "1"])
        peak = run["json"]["peak_memory"][0]
        measured = peak["training_peak_bytes"] - peak["baseline_bytes"]
        ratio = estimated / measured
        figure = f"estimated {estimated / 2**20:,.0f} MiB, measured {measured / 2**20:,.0f} MiB ({100 * (ratio - 1):+.0f}%)"
        if peak.get("peak_reserved_bytes"):
            figure += f", reserved {peak['peak_reserved_bytes'] / 2**20:,.0f} MiB"
        return (PASS if abs(ratio - 1) <= 0.2 else BELOW), figure
    nlp = ["--device", h.device, "--data-dir", h.wikitext, *h.nlp_size()]
    h.check("peak memory vs --estimate-memory: exercise1_nlp 32", lambda: memory("nlp-32", "exercise1_nlp", nlp), MEMORY, (20, 8))
    h.check("peak memory vs --estimate-memory: exercise1_nlp bf16-mixed", lambda: memory("nlp-bf16", "exercise1_nlp", [*nlp, "--precision", "bf16-mixed"]), MEMORY, (20, 8))
    for model, estimate in [("cnn", (15, 8)), ("resnet34", (25, 25))]:
        flags = ["--device", h.device, "--model", model, "--data-dir", h.cifar]
        needs = h.needs_cuda() if model != "cnn" else None
        h.check(f"peak memory vs --estimate-memory: exercise1 {model} 32", lambda m=model, f=flags: memory(f"e1-{m}", "exercise1", f), MEMORY, estimate, needs)
    # Without cuDNN's benchmark (which tries its algorithms with their workspaces on the first
    # step): how much of the convolutional models' peak those trials are.
    flags = ["--device", h.device, "--model", "resnet34", "--data-dir", h.cifar, "--deterministic"]
    h.check("peak memory vs --estimate-memory: exercise1 resnet34 32 --deterministic (no cuDNN benchmark)",
            lambda: memory("e1-resnet34-det", "exercise1", flags), MEMORY, (25, 25), h.needs_cuda())


def image_file_setup(h):
    batch, steps, side = (4, 3, 32) if h.cpu else (256, 24, 224)
    fast = [] if h.cpu else ["--precision", "bf16-mixed", "--channels-last"]
    common = ["--device", h.device, "--model", "resnet50", "--image-size", str(side), "--batch-size", str(batch), "--max-steps", str(steps), "--epochs", "1",
              "--seed", "7", *fast]
    photos = os.path.join(h.work, "photos")
    if not os.path.isdir(photos):
        subprocess.run([os.path.join(h.bin, "prepare_data"), "generate-images", "--out", photos, "--classes", "10", "--train", str(-(-batch * steps // 10) + 2),
                        "--val", "1"], check=True, capture_output=True, env=h.env)
    return batch, steps, side, fast, common, photos


def loader_verdict(files, memory, cpu):
    """The verdict on a loader that fed `files` examples/s where the same model fed from memory
    ran `memory`: it keeps up at 95% or more. A baseline slower than the loader it judges does
    not measure the model's speed, and then the check cannot tell (a failure, on a GPU; on the
    CPU self-test the sizes are too small to judge, so it only reports)."""
    share = files / memory
    if cpu:
        return PASS, share
    if memory < 0.95 * files:
        raise CheckFailed(f"the memory-fed baseline ({memory:,.0f}/s) runs slower than the files it judges ({files:,.0f}/s): it does not measure the model's speed")
    return (PASS if share >= 0.95 else BELOW), share


def image_files(h):
    """The JSC exercise: ResNet50 from JPEG files (ImageNet's sizes), decoded on every core, at
    batch 256 in bf16 channels-last on a GPU. The loader keeps up when the steady throughput
    from the files is at least 95% of the same model's fed from memory (CIFAR-10 resized to 224,
    the whole set on the GPU: no loader at all): that is a data wait under 5% of the step. (On
    the CPU: batch 4 at 32×32.)"""
    batch = 4 if h.cpu else 256
    label = f"batch {batch}{'' if h.cpu else ' bf16 channels-last'}"

    def keeps_up():
        batch, steps, side, fast, common, photos = image_file_setup(h)
        files = h.run("r50-files", "exercise1", [*common, "--dataset", "imagefolder", "--data-dir", photos])
        memory = h.run("r50-memory", "exercise1", [*common, "--data-dir", h.cifar, "--data-on-device"])
        figure = h.healthy(files, falling=False)
        verdict, share = loader_verdict(files["json"]["steady_throughput"], memory["json"]["steady_throughput"], h.cpu)
        wait = files["json"]["data_wait_s"] / files["json"]["train_time_s"]
        return verdict, (f"{figure}; {100 * share:.0f}% of the throughput fed from memory ({memory['json']['steady_throughput']:,.0f} images/s, "
                         f"--data-on-device); data wait {100 * wait:.1f}% of training (first batch included)")
    h.check(f"exercise1 resnet50 from JPEG files, {label}: the loader keeps up", keeps_up, MACHINE, (40, 15))


def big_model(h):
    """The 1.4B-parameter Transformer's MFU at a batch that fills the GPU."""
    flags = ["--device", "cuda", "--data-dir", h.wikitext, "--emsize", "4096", "--d-hid", "4096", "--nhead", "16", "--nlayers", "12",
             "--bptt", "512", "--batch-size", "16", "--precision", "bf16-mixed", "--optimizer", "adam", "--lr", "1e-4", "--max-steps", "12",
             "--epochs", "1", "--dropout", "0"]

    def mfu():
        run = h.run("big", "exercise1_nlp", flags)
        figure = h.healthy(run, falling=False)
        data = run["json"]
        peak = data.get("peak_tflops")
        steady = data.get("steady_throughput") or data["throughput"]
        if not peak:
            return SKIPPED, figure + "; no known peak for this GPU (give --peak-tflops)"
        mfu = data["flops_per_example"] * steady / 1e12 / peak
        return (PASS if mfu >= MFU_GOAL else BELOW), f"{figure}; MFU {100 * mfu:.1f}% of {peak:.0f} TFLOP/s (goal {100 * MFU_GOAL:.0f}%)"
    h.check("1.4B Transformer bf16-mixed, 16 x 512 tokens: MFU", mfu, MACHINE, (90, 0), h.needs_cuda())

def planner(h):
    """The layout planner's profile of this machine, kept beside the table."""
    # Absolute: the binaries run in the checkout (or bundle) folder, not this process's.
    out = os.path.abspath(os.path.join(h.args.results, "plan-profile.json" if not h.cpu else "plan-profile-cpu.json"))
    if h.cpu:
        model = ["--device", "cpu", "--emsize", "32", "--d-hid", "64", "--nhead", "4", "--nlayers", "2", "--bptt", "8", "--micro-batches", "1,2", "--max-message-mb", "1"]
    else:
        model = ["--device", "cuda", "--precision", "bf16-mixed", "--nlayers", "12", "--bptt", "512", "--micro-batches", "1,2,4,8,16"]
    ranks = h.gpus if h.gpus >= 2 else (2 if h.cpu else 1)
    flags = model + (["--nproc-per-node", str(ranks)] if ranks > 1 else []) + ["--out", out]

    def profile():
        code, stdout, stderr, _ = h.spawn([os.path.join(h.bin, "exercise3"), "profile"] + flags)
        if code != 0:
            raise CheckFailed(f"exit {code}: " + (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1])
        recorded = json.load(open(out))
        sizes = [p["micro_batch"] for p in recorded["compute"]]
        layer = {p["micro_batch"]: 1e3 * (p["layer"]["forward_s"] + p["layer"]["backward_s"]) for p in recorded["compute"]}
        links = ", ".join(f"{link['scope']} all-reduce {1 / link['collectives']['all-reduce']['seconds_per_bus_byte'] / 1e9:.1f} GB/s"
                          for link in recorded["links"] if link["collectives"]["all-reduce"]["seconds_per_bus_byte"] > 0)
        # A tensor-parallel shard's own layer (its arithmetic alone) against 1/tp of the whole's.
        shards = []
        for shard in recorded.get("shards") or []:
            largest = max(shard["compute"], key=lambda p: p["micro_batch"])
            own = 1e3 * (largest["layer"]["forward_s"] + largest["layer"]["backward_s"])
            shards.append(f"tp {shard['tp']}: {own:.2f} ms ({own / (layer[largest['micro_batch']] / shard['tp']):.2f}x 1/{shard['tp']})")
        figure = (f"one layer fwd+bwd {', '.join(f'{layer[b]:.2f} ms at {b}' for b in sizes)}; a shard's layer at {max(sizes)}: "
                  f"{', '.join(shards) or 'none timed'}; {links or 'no collectives (one rank)'}; kept as {os.path.basename(out)}")
        return PASS, figure
    h.check("exercise3 profile: the planner's profile (1.4B, bf16-mixed, 512 tokens)", profile, MACHINE, (60, 20))
    h.check("the plan against runs on one GPU: step time and peak memory of every layout that fits, at 3 global batches",
            lambda: plan_against_runs(h, out), MACHINE, (120, 40))


def plan_against_runs(h, profile):
    """`exercise3 plan` for one GPU from the profile just recorded, at a few global batches;
    every layout it ranks run for a few steps; predicted against measured step time (steady
    state) and peak memory (bytes tensors held in training over what they held before), as
    `make bench-plan` compares them on CPU ranks. The rows go to <results>/plan-check.csv in
    bench-plan.csv's columns."""
    if not os.path.exists(profile):
        raise CheckFailed("no profile (the check before this one did not record it)")
    if h.cpu:
        model = ["--emsize", "32", "--d-hid", "64", "--nhead", "4", "--nlayers", "2", "--bptt", "8", "--precision", "32"]
        batches, steps, memory = [2, 4], 6, "1GiB"
    else:
        model = ["--emsize", "4096", "--d-hid", "4096", "--nhead", "16", "--nlayers", "12", "--bptt", "512", "--precision", "bf16-mixed"]
        batches, steps, memory = [8, 16, 32], 10, "78GiB"
    plan_model = [model[i + j] for i in range(0, len(model), 2) if model[i] in ("--emsize", "--nlayers", "--precision") for j in (0, 1)]
    # The profile's vocabulary is WikiText-2's (its default); the generated text has fewer
    # words, so the runs pad theirs up to it: the same model the plan predicts.
    vocab = str(json.load(open(profile))["model"]["ntoken"])
    rows, lines = [], []
    for batch in batches:
        code, stdout, stderr, _ = h.spawn([os.path.join(h.bin, "exercise3"), "plan", "--profile", profile, "--nodes", "1", "--gpus-per-node", "1",
                                              "--memory", memory, "--global-batch", str(batch), *plan_model, "--json"])
        if code != 0:
            raise CheckFailed(f"exercise3 plan: exit {code}: " + (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1])
        for rank, predicted in enumerate(json.loads(stdout)["ranked"], 1):
            binary, *layout = predicted["command"].split()
            run = h.run(f"plan-b{batch}-{rank}", binary, ["--device", h.device, "--data-dir", h.wikitext, *model, "--pad-vocab", vocab,
                                                             "--optimizer", "adam", "--lr", "1e-4", "--max-steps", str(steps), "--epochs", "1", *layout])
            data = run["json"]
            step = data["global_batch"] * data["bptt"] / data["steady_throughput"]
            held = max(p["training_peak_bytes"] - p["baseline_bytes"] for p in data["peak_memory"])
            rows.append((batch, rank, predicted, step, held))
            lines.append(f"{' '.join(layout)}: {1e3 * predicted['step_s']:.0f} vs {1e3 * step:.0f} ms ({predicted['step_s'] / step - 1:+.0%}), "
                         f"{predicted['memory_bytes'] / 2**30:.2f} vs {held / 2**30:.2f} GiB ({predicted['memory_bytes'] / held - 1:+.0%})")
    if not rows:
        raise CheckFailed(f"no layout fits in {memory} at global batches {batches}")
    cluster = f"1x{'GPU' if not h.cpu else 'CPU'} {h.gpu_name or h.device}".strip()
    started = int(h.started)
    header = "bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,predicted_memory_bytes,measured_memory_bytes,compute_s,tp_comm_s,bubble_s,exposed_comm_s,optimizer_s"
    with output.replacing(os.path.join(h.args.results, "plan-check.csv")) as f:
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

