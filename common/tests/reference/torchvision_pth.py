"""torchvision's own model, saved as its published weights are: `torch.save(model.state_dict())`.

    torchvision_pth.py MODEL LAYOUT DIR OUT.npz

MODEL is resnet34, resnet50 or vgg19 (weights=None, seeded); LAYOUT `zip` (torch.save's layout
since PyTorch 1.6) or `legacy` (the one before, which vgg19-dcbb9e9d.pth still has). The file goes
to DIR/<model>-<first 8 hex digits of its SHA-256>.pth, the way torchvision names its files.
OUT.npz holds a seeded input `x` (2 × 3 × 64 × 64), the model's logits on it in eval mode, and a
few of the state_dict's tensors under `sd.<name>`.
"""
import hashlib
import os
import sys

import numpy as np
import torch
import torchvision

model_name, layout, folder, out = sys.argv[1:5]
torch.manual_seed(0)
model = getattr(torchvision.models, model_name)(weights=None).eval()
# Running statistics that are not the initial 0 and 1, so that the buffers matter too.
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
state = model.state_dict()
partial = os.path.join(folder, model_name + ".partial")
torch.save(state, partial, _use_new_zipfile_serialization=(layout == "zip"))
digest = hashlib.sha256(open(partial, "rb").read()).hexdigest()
os.replace(partial, os.path.join(folder, f"{model_name}-{digest[:8]}.pth"))

x = torch.randn(2, 3, 64, 64)
with torch.no_grad():
    logits = model(x)
names = [n for n in state if not n.endswith("num_batches_tracked")]
keep = {f"sd.{n}": state[n].numpy() for n in (names[0], names[len(names) // 2], names[-1])}
np.savez(out, x=x.numpy(), logits=logits.numpy(), **keep)
