"""The tiers: the checks cut into runs of at most TIER_SECONDS each on an H200 by their recorded
wall times (a 15-minute allocation then holds a tier, the machine's start and a rerun). First
the verdicts (the multi-rank paths, which had never carried a byte between ranks, then every
exercise learning and the speed features equal to the plain path), then the side-by-side
timings against every PyTorch peer, then the machine's figures (MFU, the planner's profile and
plan, memory, the profiler, JPEG files).

`--tier N` runs one; `--next` the first that the committed table (results/gpu-check.json, in the
bundle committed-gpu-check.json) has no rows for; `--tiers` lists them with their expected time.
"""

# Seconds a tier may take on an H200, by its rows' recorded (else estimated) times and its data.
TIER_SECONDS = 360
# Generating the data sets before the first check (measured on an H200's node: about 15 s).
DATA_SECONDS = 20

MULTIRANK, LEARNING = 1, 1
FEATURES = 2
MEMORY = 9
MACHINE = 10
# The course as taught (`--tier course`).
COURSE = 11
# The side-by-side timings: (precision, entry) -> tier, sized by their runs (every peer, a
# warm-up and 3 rounds each; torch.compile's warm-up the largest part).
TIMINGS = {
    ("32", "cnn"): 2, ("32 --cuda-graph", "cnn"): 2,
    ("32", "nlp"): 3, ("32 --cuda-graph", "nlp"): 3,
    ("32", "resnet34"): 4, ("32", "lightning"): 4,
    ("32", "vgg19"): 5,
    ("bf16-mixed", "cnn"): 6, ("bf16-mixed", "nlp"): 6,
    ("bf16-mixed", "resnet34"): 7,
    ("bf16-mixed", "vgg19"): 8,
    ("32", "resnet50 jpeg"): 9,
}

NAMES = {
    1: "verdicts: the multi-rank paths (2 and 4 ranks against 1), every exercise learning in every precision",
    2: "verdicts: the speed features equal to the plain path; timings float32: the CNN, eager and --cuda-graph",
    3: "timings float32: exercise1_nlp, eager and --cuda-graph",
    4: "timings float32: ResNet34; the Lightning Trainer",
    5: "timings float32: VGG19",
    6: "timings bf16-mixed: the CNN, exercise1_nlp",
    7: "timings bf16-mixed: ResNet34",
    8: "timings bf16-mixed: VGG19",
    9: "ResNet50 from JPEG files against torchvision's DataLoader; memory against --estimate-memory; the profiler",
    10: "the machine: the 1.4B model's MFU, the planner's profile and its plan against runs, JPEG files keeping up",
    11: "the course as taught (--tier course): exercise1 --device both, ResNet34 and VGG19 for 5 epochs, exercise1_nlp's 3 epochs, why_gpus, exercise2 and exercise3 ddp on 2 ranks, the slides' Pipe example",
}
# Tiers by name.
ALIASES = {"course": COURSE}


def tier_number(text):
    """A tier given on the command line: its number or its name."""
    if text in ALIASES:
        return ALIASES[text]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a tier: {text!r} (a number, or {', '.join(ALIASES)})")


def expected(harness, tier):
    """The seconds tier `tier` is expected to take here: its checks' recorded or estimated times
    and the data's."""
    return DATA_SECONDS + sum(harness.estimate(p) for p in harness.plan if p.tier == tier and not p.needs)


def had(committed, harness, tier):
    """Whether the committed table has a row that ran for every check of `tier` that can run here."""
    done = {r.get("check", r["path"]) for r in (committed or {}).get("checks", []) if r["verdict"] not in ("not run (budget)", "not run (not reached)",
                                                                                                        "not run (interrupted)")}
    return all(p.path in done for p in harness.plan if p.tier == tier and not p.needs)


def next_tier(committed, harness):
    """The first tier the committed table lacks, or None when it has them all."""
    return next((t for t in sorted(NAMES) if not had(committed, harness, t)), None)


def listing(committed, harness):
    lines = []
    for t in sorted(NAMES):
        checks = [p for p in harness.plan if p.tier == t]
        state = "in the committed table" if had(committed, harness, t) else "not yet run"
        lines.append(f"tier {t}: {NAMES[t]} ({len(checks)} checks, about {expected(harness, t):.0f} s; {state})")
    return "\n".join(lines)
