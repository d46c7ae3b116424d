"""Tier 2's verdicts: each speed feature against the plain path, equal where it claims to be."""
import os

from .harness import CheckFailed
from .table import PASS
from .tiers import FEATURES


def plan(h):
    gpu = h.one_gpu()

    # Comparisons of two paths run both with --deterministic: cuDNN's benchmark times its
    # algorithms anew in each run and may keep different ones, whose roundings Adam's
    # sign-like first steps then amplify (2.6e-3 apart after 40 steps on an H100).
    def graphed_cnn():
        run = h.image("e1-cnn-graph-det", "cnn", "32", ["--cuda-graph", "--deterministic"])
        base = h.image("e1-cnn-32-det", "cnn", "32", ["--deterministic"])
        return PASS, h.healthy(run) + "; " + h.same_losses(run, base, 1e-5)
    h.check("exercise1 cnn --cuda-graph = eager", graphed_cnn, FEATURES, (15, 5), h.needs_cuda())

    def graphed_nlp():
        run = h.nlp("nlp-graph", "32", ["--cuda-graph"])
        base = h.cached("nlp-32", lambda: h.nlp("nlp-32"))
        return PASS, h.healthy(run) + "; " + h.same_losses(run, base, 2e-3)
    h.check("exercise1_nlp --cuda-graph = eager", graphed_nlp, FEATURES, (20, 5), h.needs_cuda())

    layout_model = "cnn" if h.cpu else "resnet34"

    # The two layouts run different cuDNN kernels (TF32 where cuDNN's default allows it, as
    # PyTorch's), whose roundings differ; training from scratch then amplifies them: on an
    # H100, 1.7e-4 apart at step 1, 5e-3 at step 2, 0.4 by step 28, with Adam and with SGD.
    # So: the same loss on the same weights and batch (step 1), and both learn.
    def channels_last():
        run = h.image(f"e1-{layout_model}-cl-det", layout_model, "32", ["--channels-last", "--deterministic"])
        base = h.image(f"e1-{layout_model}-32-det", layout_model, "32", ["--deterministic"])
        h.healthy(base)
        return PASS, h.healthy(run) + "; " + h.same_losses(run, base, 1e-3, steps=1)
    h.check(f"exercise1 {layout_model} --channels-last: the same model", channels_last, FEATURES, (25, 8))

    def optimizer_kernels():
        fused = h.image("e1-cnn-fused", "cnn", "32", ["--optimizer-kernel", "fused", "--deterministic"])
        single = h.image("e1-cnn-per-parameter", "cnn", "32", ["--optimizer-kernel", "per-parameter", "--deterministic"])
        # The kernels round differently in the last bits, which Adam's first, sign-like
        # updates amplify: on an H100 equal to 1e-3 up to step 22, 1e-2 apart at step 40.
        return PASS, h.same_losses(fused, single, 1e-3, steps=10)
    h.check("exercise1 cnn Adam: fused kernel = per-parameter", optimizer_kernels, FEATURES, (20, 8))
    h.check("exercise1 cnn --data-on-device", lambda: (PASS, h.healthy(h.image("e1-cnn-resident", "cnn", "32", ["--data-on-device"]))), FEATURES, (12, 5))
    h.check("exercise1 cnn --matmul-precision high", lambda: (PASS, h.healthy(h.image("e1-cnn-tf32", "cnn", "32", ["--matmul-precision", "high"]))), FEATURES,
            (12, 5))

    def schedule(s):
        run = h.pipeline(s)
        base = h.cached("pp-gpipe", lambda: h.pipeline("gpipe"))
        return PASS, h.healthy(run) + "; " + h.same_losses(run, base, 2e-3) + " with gpipe"
    for s in ["1f1b", "interleaved"]:
        h.check(f"exercise3 pipeline {s} = gpipe, both stages on {gpu}", lambda s=s: schedule(s), FEATURES, (15, 8))
    h.check("exercise3 pipeline gpipe 16-mixed (gradient scaler)", lambda: (PASS, h.healthy(h.pipeline("gpipe", ["--precision", "16-mixed"]))), FEATURES,
            (15, 8), h.needs_cuda())

    def resume():
        ckpt = os.path.join(h.work, "ckpt")
        flags = ["--data-dir", h.cifar_tiny, "--batch-size", "20", "--seed", "7", "--device", h.device, "--checkpoint-dir"]
        straight = h.run("e1-straight", "exercise1", flags + [os.path.join(ckpt, "a"), "--epochs", "2"])
        h.run("e1-first", "exercise1", flags + [os.path.join(ckpt, "b"), "--epochs", "1"])
        resumed = h.run("e1-resumed", "exercise1", flags + [os.path.join(ckpt, "b"), "--epochs", "2", "--resume"])
        tail = h.losses(straight)[-len(h.losses(resumed)):]
        worst = max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(tail, h.losses(resumed)))
        if worst > 1e-3 or resumed["json"]["resumed_epochs"] != 1:
            raise CheckFailed(f"epoch 2 resumed differs from straight by {worst:.2e} (resumed_epochs {resumed['json']['resumed_epochs']})")
        return PASS, f"epoch 2 after --resume = straight (largest relative difference {worst:.1e})"
    h.check("exercise1 checkpoint + --resume", resume, FEATURES, (25, 12))
