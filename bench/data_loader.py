"""torchvision's input pipeline alone, for `make bench-data` (bench/data.sh): images per second
of DataLoader(ImageFolder(train, transform), batch_size, num_workers, shuffle=True) with
torchvision's ImageNet transforms (RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor +
Normalize; or Resize(256) + CenterCrop(224) + ToTensor + Normalize), nothing trained: what
target/release/bench_data measures of ours, on the same files. Prints one JSON line.

--compare FILE: instead, read the first batch our loader wrote with the eval transform (raw
float32 [B, 3, 224, 224], the folder's order) and print how far it is from torchvision's, in
units of one byte of the image before normalisation.
"""
import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def transform(train):
    steps = [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip()] if train else [transforms.Resize(256), transforms.CenterCrop(224)]
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--transform", choices=["train", "eval"], default="train")
    parser.add_argument("--compare")
    args = parser.parse_args()
    # The main process only receives the workers' batches: its own threads would take cores.
    torch.set_num_threads(1)
    folder = datasets.ImageFolder(f"{args.data_dir}/train", transform(args.transform == "train"))
    if args.compare:
        return compare(folder.samples, args)
    loader = DataLoader(folder, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, prefetch_factor=2 if args.workers else None)
    batches = iter(loader)
    for _ in range(args.warmup):
        next(batches)
    # CPU time of this process and of its worker processes, all alive while timed.
    pids = [os.getpid()] + [w.pid for w in getattr(batches, "_workers", [])]
    started, cpu_started = time.perf_counter(), cpu_seconds(pids)
    images = sum(len(next(batches)[1]) for _ in range(args.batches))
    seconds, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu_started
    print(json.dumps({"loader": "torchvision", "workers": args.workers, "images": images, "seconds": seconds, "images_per_s": images / seconds, "cpu_seconds": round(cpu, 3)}))


def cpu_seconds(pids):
    """User + system CPU time of these processes (all their threads), from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def compare(samples, args):
    eval_folder = datasets.ImageFolder(f"{args.data_dir}/train", transform(False))
    n = min(args.batch_size, len(samples))
    theirs = torch.stack([eval_folder[i][0] for i in range(n)])
    ours = torch.frombuffer(bytearray(open(args.compare, "rb").read()), dtype=torch.float32).view(n, 3, 224, 224)
    # Back to units of one byte: x = (b / 255 - mean) / std.
    diff = (ours - theirs).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255
    print(json.dumps({"compare": "eval transform, ours vs torchvision (PIL)", "images": n, "max_byte_diff": round(diff.max().item(), 3),
                      "mean_byte_diff": round(diff.mean().item(), 4), "share_within_1": round((diff <= 1.001).float().mean().item(), 5)}))


if __name__ == "__main__":
    main()
