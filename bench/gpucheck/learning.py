"""Tier 1's second half: every exercise runs and learns on CUDA, in every precision; the
pipeline with both stages on one GPU."""
from .table import PASS
from .tiers import LEARNING


def plan(h):
    precisions = ["32", "16-mixed", "bf16-mixed"]
    for model, estimate in [("cnn", (12, 5)), ("resnet34", (20, 20)), ("vgg19", (25, 30))]:
        for precision in precisions:
            needs = h.needs_cuda() if (precision == "16-mixed" or model != "cnn") else None
            h.check(f"exercise1 {model} {precision}", lambda m=model, p=precision: (PASS, h.healthy(h.image(f"e1-{m}-{p}", m, p))), LEARNING, estimate, needs)
    for precision in precisions:
        needs = h.needs_cuda() if precision == "16-mixed" else None
        h.check(f"exercise1_nlp {precision}", lambda p=precision: (PASS, h.healthy(h.nlp(f"nlp-{p}", p))), LEARNING, (15, 6), needs)
    # Lightning 2's true half precisions: the whole model in 16 bits (16-true needs a GPU).
    for model, estimate in [("cnn", (12, 5)), ("resnet34", (20, 20))]:
        for precision in ["16-true", "bf16-true"]:
            needs = h.needs_cuda() if (precision == "16-true" or model != "cnn") else None
            h.check(f"exercise1 {model} {precision}", lambda m=model, p=precision: (PASS, h.healthy(h.image(f"e1-{m}-{p}", m, p))), LEARNING, estimate, needs)
    for precision in ["16-true", "bf16-true"]:
        needs = h.needs_cuda() if precision == "16-true" else None
        h.check(f"exercise1_nlp {precision}", lambda p=precision: (PASS, h.healthy(h.nlp(f"nlp-{p}", p))), LEARNING, (15, 6), needs)
    h.check(f"exercise3 pipeline gpipe, both stages on {h.one_gpu()}", lambda: (PASS, h.healthy(h.pipeline("gpipe"))), LEARNING, (15, 8))
