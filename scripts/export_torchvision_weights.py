#!/usr/bin/env python3
"""Export torchvision's ImageNet weights for the course models to a .safetensors file.

The Rust models (common::models) use torchvision's exact parameter names, so the exported
file loads with `common::models::load_weights`. Run this once on a machine that has
torchvision (and either network access or the weights already in the torch hub cache,
~/.cache/torch/hub/checkpoints), then copy the file to where training runs:

    python scripts/export_torchvision_weights.py --model resnet34 --out resnet34.safetensors
    python scripts/export_torchvision_weights.py --model resnet50 --out resnet50.safetensors
    python scripts/export_torchvision_weights.py --model vgg19 --out vgg19.safetensors

Needs: torch, torchvision, safetensors (pip install torchvision safetensors).

The file holds the 1000-class ImageNet head: it loads whole into the course's 1000-way model
(the default), and into a model with another head (--num-classes 10, or transfer learning's
--freeze backbone / --train-last N) all but the head, which starts new.

Batch-norm `num_batches_tracked` counters are dropped: tch's batch norm has no such buffer (its
momentum is fixed).
"""
import argparse
import sys

import torchvision

MODELS = {"resnet34": torchvision.models.resnet34, "resnet50": torchvision.models.resnet50, "vgg19": torchvision.models.vgg19}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--out", required=True, help="output file, e.g. resnet34.safetensors")
    args = parser.parse_args()

    try:
        from safetensors.torch import save_file
    except ImportError:
        sys.exit("error: the safetensors package is missing; install it with `pip install safetensors`")

    model = MODELS[args.model](weights="IMAGENET1K_V1")
    # safetensors stores each tensor once and refuses shared or non-contiguous storage.
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not name.endswith("num_batches_tracked")
    }
    save_file(state, args.out, metadata={"source": f"torchvision.models.{args.model} IMAGENET1K_V1"})
    print(f"wrote {len(state)} tensors of {args.model} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
