"""Reference trajectories of torch.optim for common/tests/optim_parity.rs.

Usage: optim_parity.py OUT.npz

With a fixed seed, builds a small network (conv 1->4 k3 pad 1, ReLU, max-pool 2, linear 64->32,
ReLU, linear 32->10), 20 batches of random 1x8x8 inputs and class targets, and trains a copy of
the network for 20 steps with each optimizer configuration in CONFIGS (cross-entropy loss, some
with gradient-norm clipping), using the single-tensor code path of torch.optim (foreach=False)
that the Rust optimizers mirror.

The .npz holds (all float32 but the int64 targets):
    init.<param>            initial weights, torch's default initialisation
    x.<i>, y.<i>            batch i: inputs [16, 1, 8, 8], targets [16] (a linear rule of x)
    loss.<config>           [20] the loss of each step, before that step's update
    grad_norm.<config>      [20] clip_grad_norm_'s result per step (clipping configs only)
    final.<config>.<param>  the weights after the 20 updates
"""

import sys

import numpy as np
import torch
import torch.nn.functional as F

SEED = 0
STEPS = 20
BATCH = 16

# name -> (optimizer factory, max_norm for clip_grad_norm_ before each step or None).
# Keep in sync with configs() in optim_parity.rs.
CONFIGS = {
    "adam": (lambda ps: torch.optim.Adam(ps, foreach=False), None),
    "adam_wd": (lambda ps: torch.optim.Adam(ps, weight_decay=0.01, foreach=False), None),
    "adam_clip": (lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), 0.5),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False), None),
    "sgd_nesterov_wd": (
        lambda ps: torch.optim.SGD(
            ps, lr=0.05, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=5e-4, foreach=False
        ),
        None,
    ),
    "sgd_dampening_wd": (
        lambda ps: torch.optim.SGD(
            ps, lr=0.05, momentum=0.8, dampening=0.1, weight_decay=1e-3, foreach=False
        ),
        None,
    ),
    # torch's multi-tensor paths (the ones it takes on a GPU), on the CPU: the fused kernels
    # and the foreach ones, against the Rust optimizers' LibTorch fused path.
    "adam_fused": (lambda ps: torch.optim.Adam(ps, fused=True), None),
    "adam_foreach_wd": (lambda ps: torch.optim.Adam(ps, weight_decay=0.01, foreach=True), None),
    "adam_fused_clip": (lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True), 0.5),
    "sgd_fused_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True), None),
    "sgd_fused_nesterov_wd": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True),
        None,
    ),
    "sgd_foreach_dampening_wd": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.1, weight_decay=1e-3, foreach=True),
        None,
    ),
    "sgd_fused_plain": (lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True), None),
}


def forward(p, x):
    """The network as functional ops, so the Rust test can spell it op for op."""
    h = F.conv2d(x, p["conv.weight"], p["conv.bias"], padding=1)
    h = F.max_pool2d(F.relu(h), 2)
    h = F.relu(F.linear(h.flatten(1), p["fc1.weight"], p["fc1.bias"]))
    return F.linear(h, p["fc2.weight"], p["fc2.bias"])


def main(out_path):
    torch.manual_seed(SEED)
    modules = {
        "conv": torch.nn.Conv2d(1, 4, 3, padding=1),
        "fc1": torch.nn.Linear(64, 32),
        "fc2": torch.nn.Linear(32, 10),
    }
    init = {
        f"{m}.{n}": t.detach().clone()
        for m, module in modules.items()
        for n, t in module.named_parameters()
    }
    # Targets follow a fixed random linear rule of the inputs, so training makes progress
    # and the trajectories of the configurations clearly differ.
    rule = torch.randn(64, 10)
    xs = [torch.randn(BATCH, 1, 8, 8) for _ in range(STEPS)]
    batches = [(x, (x.flatten(1) @ rule).argmax(1)) for x in xs]

    arrays = {f"init.{n}": t.numpy() for n, t in init.items()}
    for i, (x, y) in enumerate(batches):
        arrays[f"x.{i}"] = x.numpy()
        arrays[f"y.{i}"] = y.numpy()

    for config, (make, max_norm) in CONFIGS.items():
        params = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        opt = make(list(params.values()))
        losses, norms = [], []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(forward(params, x), y)
            loss.backward()
            if max_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
                norms.append(norm.item())
            opt.step()
            losses.append(loss.item())
        arrays[f"loss.{config}"] = np.array(losses, dtype=np.float32)
        if max_norm is not None:
            arrays[f"grad_norm.{config}"] = np.array(norms, dtype=np.float32)
        for n, t in params.items():
            arrays[f"final.{config}.{n}"] = t.detach().numpy()

    for name, a in arrays.items():
        assert a.dtype in (np.float32, np.int64), (name, a.dtype)
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
