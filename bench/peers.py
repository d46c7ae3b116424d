"""What the PyTorch peers of `make bench` share (bench/exercise1_reference.py,
bench/exercise1_nlp_reference.py): the flags that choose a peer, the refusal of a peer that does
not exist on the device, the optimizer's implementation, the step clock, the whole step in a
CUDA graph, and the check that the run trained.

A peer is the same model, data, batch, precision and recipe as our binary, trained the way a
demanding PyTorch user would: eager with the optimizer's default implementation (`--fused` off:
foreach kernels on a GPU, a per-parameter loop on the CPU), with its fused kernel (`--fused`),
channels-last for the conv nets (`--channels-last`), `torch.compile` (`--compile default`),
CUDA graphs through `torch.compile(mode="reduce-overhead")` (`--compile reduce-overhead`) or a
hand-captured whole step (`--cuda-graph`).

Timing, as common/src/train/mod.rs times our steps: one device synchronisation per step, after
the optimizer; the steady state runs from one step's end to the next one's after
--steady-after steps. The per-phase split (data, forward+backward, optimizer) comes from CUDA
events recorded in the stream on a GPU, read once after the run, so that it adds no wait;
from host clocks on the CPU, where nothing is asynchronous.
"""
import math
import sys
import time

import torch

# Ordinary steps before the capture: common/src/train/graph.rs's WARMUP_STEPS, and the 3
# iterations of PyTorch's whole-network capture example (CUDA semantics, "CUDA Graphs").
GRAPH_WARMUP_STEPS = 3


def add_peer_flags(p):
    p.add_argument("--fused", action="store_true",
                   help="the optimizer's fused kernel (fused=True; CPU and CUDA in torch 2.11) instead of its default implementation")
    p.add_argument("--compile", nargs="?", const="default", choices=["default", "reduce-overhead"], default=None,
                   help="torch.compile the model: default mode (the flag alone), or reduce-overhead (CUDA graphs; GPU only)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole training step (forward, backward, clipping, optimizer) in one CUDA graph and replay it "
                        "for every batch, with capturable Adam (GPU only)")


def usage_error(message):
    """One line on stderr and exit status 2, as the binaries answer bad flags."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_peer(a, device):
    """Refuses a peer that does not exist on `device` (rather than running another one under its name)."""
    if device.type not in ("cpu", "cuda"):
        usage_error(f"--device {a.device}: use cpu or cuda")
    if a.cuda_graph and device.type != "cuda":
        usage_error("--cuda-graph captures the step in a CUDA graph, which needs --device cuda: there is no such peer on the CPU")
    if a.compile == "reduce-overhead" and device.type != "cuda":
        usage_error("--compile reduce-overhead replays CUDA graphs, which needs --device cuda: on the CPU it would be "
                    "the default mode under another name (use --compile)")
    if a.cuda_graph and a.compile:
        usage_error("--cuda-graph captures the eager step by hand; for torch.compile's CUDA graphs use --compile reduce-overhead alone")
    if a.fused:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # what torch.optim checks fused=True against
        if device.type not in _get_fused_kernels_supported_devices():
            usage_error(f"--fused: torch {torch.__version__} has no fused optimizer kernels on {device.type}")


def optimizer_kwargs(a, capturable=False):
    """The optimizer's implementation: its default (fused and foreach left to torch), or its fused
    kernel; `capturable` (Adam: its step counts on the device, so that no host value is baked into
    a graph) for the captured step."""
    kwargs = {"fused": True} if a.fused else {}
    if capturable and a.cuda_graph:
        kwargs["capturable"] = True
    return kwargs


def describe_optimizer(optimizer):
    """How the optimizer updates: "fused", or "default" (torch's choice: foreach on a GPU, a loop on the CPU)."""
    return "fused" if optimizer.param_groups[0].get("fused") else "default"


class StepClock:
    """Each step's phase boundaries: CUDA events recorded in the current stream on a GPU (no
    wait; read after the run's last synchronisation), host clocks on the CPU. A step is `begin`,
    `mark` after its batch is ready, `mark` after the backward pass (eager steps), `end` after
    the optimizer (or the graph's replay)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.steps = []  # (kind, [marks]): kind "eager" or "replay"
        self.current = None

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self):
        self.current = [self._now()]

    def mark(self):
        self.current.append(self._now())

    def discard(self):
        """The step begun did not happen (its epoch ran out of batches)."""
        self.current = None

    def end(self, kind):
        self.current.append(self._now())
        self.steps.append((kind, self.current))
        self.current = None

    def _seconds(self, a, b):
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def phases(self):
        """Seconds in each phase over all steps: data_wait_s, forward_backward_s, optimizer_s (eager
        steps), graph_replay_s (replayed steps: forward, backward and optimizer are one launch)."""
        sums = {"data_wait_s": 0.0, "forward_backward_s": 0.0, "optimizer_s": 0.0, "graph_replay_s": 0.0}
        for kind, m in self.steps:
            sums["data_wait_s"] += self._seconds(m[0], m[1])
            if kind == "eager":
                sums["forward_backward_s"] += self._seconds(m[1], m[2])
                sums["optimizer_s"] += self._seconds(m[2], m[3])
            else:
                sums["graph_replay_s"] += self._seconds(m[1], m[2])
        return sums


class GraphedStep:
    """The whole training step in one CUDA graph, as PyTorch's whole-network capture example
    does it and as our --cuda-graph does (common/src/train/graph.rs): GRAPH_WARMUP_STEPS ordinary
    steps on a side stream (they choose cuDNN's algorithms, make the optimizer's state and the
    gradients), then one step recorded on that same stream, reading its batch from fixed input
    tensors, then each batch copied into those tensors and the graph replayed. The gradients
    are not reset between replays (the recorded backward pass writes them afresh); dropout
    draws new masks on every replay (the graph registers the default generator). A batch of
    another shape (an epoch's shorter last batch) trains without the graph, on the same
    parameters and optimizer state.

    `step(inputs, targets, mark)` runs forward, loss, backward (then calls `mark`), clipping
    and the optimizer, and returns (loss, hits) as tensors; it must not read a device value
    on the host (nothing may wait for the device during a capture)."""

    def __init__(self, step, optimizer):
        self.step, self.optimizer = step, optimizer
        self.warmup_left = GRAPH_WARMUP_STEPS
        self.stream = torch.cuda.Stream()  # warm-up and capture on one stream (per-stream library handles)
        self.graph = None

    def __call__(self, inputs, targets, clock):
        """One optimizer step; returns (loss, hits, kind) with kind "eager" or "replay"."""
        if self.warmup_left > 0:
            self.warmup_left -= 1
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                loss, hits = self.step(inputs, targets, clock.mark)
            torch.cuda.current_stream().wait_stream(self.stream)
            return loss, hits, "eager"
        if self.graph is None:
            self._capture(inputs, targets)
        if inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            # After the capture the gradients are the graph's tensors: zeroed, not replaced.
            loss, hits = self.step(inputs, targets, clock.mark, set_to_none=False)
            return loss, hits, "eager"
        self.inputs.copy_(inputs)
        self.targets.copy_(targets)
        self.graph.replay()
        # The graph's outputs are overwritten by the next replay; the caller copies them.
        return self.loss, self.hits, "replay"

    def _capture(self, inputs, targets):
        self.inputs, self.targets = inputs.clone(), targets.clone()
        # The recorded backward pass then allocates the gradients from the graph's pool.
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.loss, self.hits = self.step(self.inputs, self.targets, lambda: None)


def finite_or_exit(what, losses):
    """A diverged peer's speed is not a training speed: exit 1 with one line when a loss is not finite."""
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        print(f"error: {what}: the training loss is {losses[bad[0]]} at step {bad[0] + 1}: the run diverged, "
              "and its throughput is not a training speed", file=sys.stderr)
        sys.exit(1)
