"""torch.optim.lr_scheduler.OneCycleLR's learning rates, for common/tests/engine.rs.

Usage: one_cycle.py OUT.npz

For max_lr 0.1 and 100 steps (torch's other defaults: pct_start 0.3, cosine annealing,
div_factor 25, final_div_factor 1e4), and for max_lr 2.0 over 37 steps with pct_start 0.25,
records the learning rate each of the steps runs at (the optimizer's lr before step i's update).

The .npz holds float64 arrays:
    lr.default   [100]
    lr.short     [37]
"""

import sys

import numpy as np
import torch


def rates(max_lr, total_steps, **kwargs):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=max_lr, total_steps=total_steps, cycle_momentum=False, **kwargs
    )
    out = []
    for _ in range(total_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step() if len(out) < total_steps else None
    return np.array(out, dtype=np.float64)


def main():
    out = sys.argv[1]
    np.savez(out, **{"lr.default": rates(0.1, 100), "lr.short": rates(2.0, 37, pct_start=0.25)})


if __name__ == "__main__":
    main()
