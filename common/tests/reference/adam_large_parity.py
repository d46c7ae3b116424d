"""Reference for common/tests/optim_parity.rs's test of Adam on parameters large enough that the
Rust Adam's CPU update (common/src/optim/adam.rs, `fused`) splits them between threads: torch.optim.Adam's single-tensor
path (foreach=False, what torch uses on the CPU by default) over a few steps with given
gradients.

Usage: adam_large_parity.py OUT.npz

The .npz holds (float32):
    init.<param>            initial values
    grad.<param>            the gradient direction; step k's gradient is grad * SCALES[k]
    final.<config>.<param>  the parameters after len(SCALES) steps
"""

import sys

import numpy as np
import torch

SHAPES = {"big": (600_011,), "matrix": (301, 1001), "small": (7,)}
SCALES = [1.0, -0.5, 2.0]  # keep in sync with optim_parity.rs
CONFIGS = {
    "adam": dict(lr=1e-3),
    "adam_wd": dict(lr=1e-2, weight_decay=0.01),
}


def main(out_path):
    torch.manual_seed(1)
    init = {n: torch.randn(s) for n, s in SHAPES.items()}
    grad = {n: torch.randn(s) for n, s in SHAPES.items()}
    arrays = {f"init.{n}": t.numpy() for n, t in init.items()}
    arrays.update({f"grad.{n}": t.numpy() for n, t in grad.items()})
    for config, kwargs in CONFIGS.items():
        params = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        opt = torch.optim.Adam(list(params.values()), foreach=False, **kwargs)
        for scale in SCALES:
            for n, p in params.items():
                p.grad = grad[n] * scale
            opt.step()
        for n, p in params.items():
            arrays[f"final.{config}.{n}"] = p.detach().numpy()
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
