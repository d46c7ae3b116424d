#!/usr/bin/env python3
"""exercise1's CNN trained the way the course's own slides train it: a LightningModule and
pytorch-lightning's `Trainer`, as the second peer beside PyTorch eager (bench/gpu_check.py).

    python bench/exercise1_lightning.py --data-dir data/cifar10 --device cuda --max-steps 200

The same model (the course's CNN, bench/vision_models.py), data (CIFAR-10's binary batches in
--data-dir, normalised per channel), batch 100, Adam lr 1e-3 and cross-entropy as
target/release/exercise1, shuffled every epoch, no augmentation. The data set is held as one
normalised float tensor and served by a DataLoader without workers (the cheapest way a Lightning
user feeds it); Lightning moves each batch to the device. Throughput is the steady state: images
over the time from one training batch's end to the next one's (the device synchronised), after
the first --steady-after steps, as the Rust loop measures it.

Prints one JSON line: {"impl": "lightning", "steady_throughput": ..., ...}.
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
import vision_models  # noqa: E402
from exercise1_reference import MEAN, STD, normalize, read_cifar10_train  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data/cifar10")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--steady-after", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    warnings.filterwarnings("ignore")  # Lightning's advice (workers, logging) is not this comparison's business
    import pytorch_lightning as pl

    class Cnn(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, _ = vision_models.build("cnn", 10)

        def training_step(self, batch, _index):
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=a.lr)

    class SteadyClock(pl.Callback):
        def __init__(self):
            self.last, self.seconds, self.images, self.steps = None, 0.0, 0, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
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

    images, labels, _generated = read_cifar10_train(a.data_dir)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    dataset = torch.utils.data.TensorDataset(normalize(images, mean, std), labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch_size, shuffle=True, num_workers=0, pin_memory=a.device == "cuda",
                                         generator=torch.Generator().manual_seed(a.seed))
    pl.seed_everything(a.seed, verbose=False)
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True  # as the Rust binary sets it
    clock = SteadyClock()
    trainer = pl.Trainer(accelerator="gpu" if a.device == "cuda" else "cpu", devices=1, max_steps=a.max_steps, max_epochs=-1, precision="32-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                         num_sanity_val_steps=0)
    started = time.perf_counter()
    trainer.fit(Cnn(), loader)
    print(json.dumps({
        "impl": "lightning", "lightning": pl.__version__, "exercise": "exercise1", "model": "cnn", "device": a.device, "batch_size": a.batch_size,
        "steps": clock.steps, "seconds": time.perf_counter() - started,
        "steady_throughput": clock.images / clock.seconds if clock.seconds else None, "steady_steps": max(0, clock.steps - a.steady_after),
    }))


if __name__ == "__main__":
    main()
