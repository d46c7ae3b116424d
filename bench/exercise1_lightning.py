#!/usr/bin/env python3
"""exercise1's image models trained the way the course's own slides train them: a LightningModule
and pytorch-lightning's `Trainer`, a peer beside PyTorch eager (bench/bench.sh's `lightning`,
bench/gpu_check.py).

    python bench/exercise1_lightning.py --data-dir data/cifar10 --device cuda --max-steps 200
    python bench/exercise1_lightning.py --model resnet34 --device cuda --precision bf16-mixed --fused

The same model (bench/vision_models.py: the course's CNN by default), data (CIFAR-10's binary
batches in --data-dir, normalised per channel), batch 100, Adam lr 1e-3 (its default
implementation, or --fused) and cross-entropy as target/release/exercise1, shuffled every epoch,
no augmentation; precision 32 ("32-true") or bf16-mixed (Lightning's "bf16-mixed": autocast, as
ours). The data set is held as one normalised float tensor and served by a DataLoader without
workers (the cheapest way a Lightning user feeds it); Lightning moves each batch to the device.
Throughput is the steady state: images over the time from one training batch's end to the next
one's (the device synchronised there, once per step, as the Rust loop waits), after the first
--steady-after steps. Lightning's hooks give no per-phase split: its JSON has none.

The Trainer is told its cluster environment (a single local process, LightningEnvironment)
rather than left to probe for one: its probe imports mpi4py wherever that is installed, and on
a GPU node whose MPI cannot initialise outside a launcher that import aborts the process
("Local abort before MPI_INIT completed").

Prints one JSON line: {"impl": "lightning", "steady_throughput": ..., ...}; exits 1 when a
step's loss is not finite.
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import vision_models  # noqa: E402
from exercise1_reference import MEAN, STD, normalize, read_cifar10_train  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet34", "resnet50", "vgg19"])
    p.add_argument("--data-dir", default="data/cifar10")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--steady-after", type=int, default=3)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    p.add_argument("--fused", action="store_true", help="Adam's fused kernel (fused=True) instead of its default implementation")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()
    if a.max_steps < 1:
        peers.usage_error("--max-steps must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)

    warnings.filterwarnings("ignore")  # Lightning's advice (workers, logging) is not this comparison's business
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.environments import LightningEnvironment

    num_classes = 10 if a.model == "cnn" else 1000

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, _ = vision_models.build(a.model, num_classes)

        def training_step(self, batch, _index):
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=a.lr, **({"fused": True} if a.fused else {}))

    class SteadyClock(pl.Callback):
        def __init__(self):
            self.last, self.seconds, self.images, self.steps = None, 0.0, 0, 0
            self.losses = torch.zeros(a.max_steps, dtype=torch.float64)

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if self.steps == 0:
                self.losses = self.losses.to(module.device)
            self.losses[self.steps] = outputs["loss"].detach()  # on the device: no wait here
            if a.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.steps += 1
            if self.steps > a.steady_after and self.last is not None:
                self.seconds += now - self.last
                self.images += len(batch[1])
            self.last = now

        def on_train_epoch_end(self, trainer, module):
            self.last = None  # an epoch boundary (the loader's restart) is not steady state

    images, labels, generated = read_cifar10_train(a.data_dir)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    dataset = torch.utils.data.TensorDataset(normalize(images, mean, std), labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch_size, shuffle=True, num_workers=0, pin_memory=a.device == "cuda",
                                         generator=torch.Generator().manual_seed(a.seed))
    pl.seed_everything(a.seed, verbose=False)
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True  # as the Rust binary sets it
    clock = SteadyClock()
    module = Classifier()
    trainer = pl.Trainer(accelerator="gpu" if a.device == "cuda" else "cpu", devices=1, max_steps=a.max_steps, max_epochs=-1,
                         precision="32-true" if a.precision == "32" else "bf16-mixed", plugins=[LightningEnvironment()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                         num_sanity_val_steps=0)
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started
    losses = clock.losses[: clock.steps].tolist()
    peers.finite_or_exit(f"exercise1_lightning {a.model}", losses)
    print(json.dumps({
        "impl": "lightning", "lightning": pl.__version__, "exercise": "exercise1", "model": a.model, "device": a.device,
        "batch_size": a.batch_size, "steps": clock.steps, "examples_per_step": a.batch_size, "unit": "images/s", "seconds": seconds,
        "steady_throughput": clock.images / clock.seconds if clock.seconds else None, "steady_steps": max(0, clock.steps - a.steady_after),
        "params": sum(p.numel() for p in module.model.parameters()), "precision": a.precision,
        "optimizer": "adam", "optimizer_impl": "fused" if a.fused else "default", "lr": a.lr,
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None, "threads": torch.get_num_threads(),
        "step_losses": losses, "last_loss": losses[-1],
        "generated_data": generated, "torch_version": torch.__version__,
    }))


if __name__ == "__main__":
    main()
