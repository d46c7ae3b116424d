#!/usr/bin/env python3
"""PyTorch reference for exercise1 and its peers: the same model, data, batch, optimizer and timing
as target/release/exercise1, trained the ways a PyTorch user would, reporting training images/s.

    python bench/exercise1_reference.py --model cnn --data-dir data/cifar10 --max-steps 30 --threads 2
    python bench/exercise1_reference.py --model resnet34 --device cuda --fused --channels-last
    python bench/exercise1_reference.py --model cnn --device cuda --compile            # torch.compile, default mode
    python bench/exercise1_reference.py --model cnn --device cuda --cuda-graph --fused # the whole step in a CUDA graph

Prints one JSON line: {"impl": "pytorch", "steady_throughput": ..., "params": ..., "step_losses": [...], ...}.

The configuration is the Rust binary's (common/src/image_classification.rs): the course's CNN
(10-way head) or torchvision's ResNet34 / ResNet50 / VGG19 (1000-way heads), CIFAR-10 from the binary
batches in --data-dir, fp32 (or bf16-mixed), batch 100, Adam lr 1e-3, cross-entropy, shuffled
every epoch, no augmentation, cudnn.benchmark on a GPU. The peers (bench/peers.py): Adam's
default implementation or --fused, --channels-last, --compile [default|reduce-overhead],
--cuda-graph; a peer that does not exist on the device is refused with one line (exit 2).

Timing mirrors common/src/train/mod.rs: an epoch's clock starts before its order is drawn and
stops after its last step (the loader's start and shutdown included); each step runs from
fetching the batch to the end of the optimizer step, with one device synchronisation, after
the optimizer, as the Rust loop waits once per step. The steady-state throughput (the figure
`make bench` compares) runs from one step's end to the next one's after --steady-after steps.
Each step's split into data wait, forward+backward (forward, loss, arg-max hits, zero_grad,
backward) and optimizer comes from CUDA events on a GPU (host clocks on the CPU), read after
the run. The run exits 1 when a step's loss is not finite. Evaluation is not timed on either
side and is skipped here.

Data path (--loader):
  memory      (default) the whole training split as one uint8 tensor; each step gathers its
              100 images by index, converts to float and normalises per channel, in the
              training thread: the cheapest way PyTorch can feed this loop.
  dataloader  torch.utils.data.DataLoader with --workers processes (default 2, prefetch 4
              batches each, as the Rust loader's threads): a BatchSampler over a RandomSampler,
              each worker gathering and normalising a whole batch (no per-image collation).
  imagefolder --data-dir is an image folder (train/<class>/*.JPEG): torchvision's
              DataLoader(ImageFolder) with RandomResizedCrop(--image-size) + RandomHorizontalFlip
              + ToTensor + Normalize (ImageNet's), --workers processes, pinned memory on a GPU:
              what `exercise1 --dataset imagefolder` is compared with (the JSC exercise).
On a GPU both leave the gathered batch as bytes in pinned memory, copy it asynchronously and
normalise on the GPU, as the Rust loader does.
"""
import argparse, json, os, sys, time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import vision_models  # noqa: E402

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
RECORD = 1 + 3 * 32 * 32


def cifar_dir(data_dir):
    nested = os.path.join(data_dir, "cifar-10-batches-bin")
    if not os.path.exists(os.path.join(data_dir, "test_batch.bin")) and os.path.isdir(nested):
        return nested
    return data_dir


def read_cifar10_train(data_dir):
    """The five training batches of the binary release: (uint8 [N, 3, 32, 32], int64 [N])."""
    d = cifar_dir(data_dir)
    raw = bytearray()
    for name in TRAIN_FILES:
        path = os.path.join(d, name)
        if not os.path.exists(path):
            raise SystemExit(f"error: CIFAR-10 file {path} is missing; run make data-cifar10")
        with open(path, "rb") as f:
            raw += f.read()
    if len(raw) % RECORD:
        raise SystemExit(f"error: {d}: not a whole number of CIFAR-10 records")
    records = torch.frombuffer(raw, dtype=torch.uint8).view(-1, RECORD)
    labels = records[:, 0].to(torch.int64)
    images = records[:, 1:].reshape(-1, 3, 32, 32).clone()
    return images, labels, os.path.exists(os.path.join(data_dir, "GENERATED.txt")) or os.path.exists(os.path.join(d, "GENERATED.txt"))


def normalize(images, mean, std):
    """common/src/data/loader.rs `normalize`: bytes → float / 255, minus mean, over std (per channel)."""
    return (images.to(torch.float32) / 255.0 - mean) / std


class MemoryLoader:
    """Batches gathered from the in-memory split in the training thread."""

    def __init__(self, images, labels, batch_size, seed, device):
        self.images, self.labels, self.batch_size, self.seed, self.device = images, labels, batch_size, seed, device
        self.mean = torch.tensor(MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32, device=device).view(1, 3, 1, 1)

    def epoch(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.labels), generator=g)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            images, labels = self.images[idx], self.labels[idx]
            if self.device.type == "cpu":
                yield normalize(images, self.mean, self.std), labels
            else:
                images = images.pin_memory().to(self.device, non_blocking=True)
                labels = labels.pin_memory().to(self.device, non_blocking=True)
                yield normalize(images, self.mean, self.std), labels


class _BatchDataset(torch.utils.data.Dataset):
    """Indexed by a whole batch of indices; a worker gathers (and on the CPU normalises) it."""

    def __init__(self, images, labels, normalize_here):
        self.images, self.labels, self.normalize_here = images, labels, normalize_here
        self.mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        idx = torch.as_tensor(indices)
        images, labels = self.images[idx], self.labels[idx]
        if self.normalize_here:
            images = normalize(images, self.mean, self.std)
        return images, labels


class DataLoaderLoader:
    """torch.utils.data.DataLoader with worker processes, whole batches per fetch."""

    def __init__(self, images, labels, batch_size, seed, device, workers, prefetch):
        self.dataset = _BatchDataset(images, labels, device.type == "cpu")
        self.batch_size, self.seed, self.device, self.workers, self.prefetch = batch_size, seed, device, workers, prefetch
        self.mean = torch.tensor(MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32, device=device).view(1, 3, 1, 1)

    def epoch(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        sampler = torch.utils.data.BatchSampler(
            torch.utils.data.RandomSampler(self.dataset, generator=g), self.batch_size, drop_last=False)
        extra = {"prefetch_factor": self.prefetch, "worker_init_fn": _one_thread} if self.workers else {}
        loader = torch.utils.data.DataLoader(
            self.dataset, sampler=sampler, batch_size=None, num_workers=self.workers,
            pin_memory=self.device.type == "cuda", **extra)
        for images, labels in loader:
            if self.device.type == "cpu":
                yield images, labels
            else:
                images = images.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                yield normalize(images, self.mean, self.std), labels


class ImageFolderLoader:
    """torchvision's DataLoader(ImageFolder) with the ImageNet training transforms."""

    def __init__(self, data_dir, image_size, batch_size, seed, device, workers, prefetch):
        from torchvision import datasets, transforms
        transform = transforms.Compose([transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.dataset = datasets.ImageFolder(os.path.join(data_dir, "train"), transform)
        self.batch_size, self.seed, self.device, self.workers, self.prefetch = batch_size, seed, device, workers, prefetch

    def epoch(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        extra = {"prefetch_factor": self.prefetch, "worker_init_fn": _one_thread} if self.workers else {}
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=g, num_workers=self.workers,
                                             pin_memory=self.device.type == "cuda", **extra)
        for images, labels in loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def _one_thread(_worker):
    torch.set_num_threads(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet34", "resnet50", "vgg19"])
    p.add_argument("--data-dir", default="data/cifar10")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-classes", type=int, default=None, help="default: 10 for cnn, 1000 for resnet34/resnet50/vgg19")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--loader", default="memory", choices=["memory", "dataloader", "imagefolder"])
    p.add_argument("--image-size", type=int, default=224, help="the crop side (--loader imagefolder)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (--loader dataloader)")
    p.add_argument("--prefetch", type=int, default=4, help="batches each worker prepares ahead")
    p.add_argument("--layouts", default="auto", choices=["auto", "torchvision", "builtin"],
                   help="where ResNet34/ResNet50/VGG19 come from: torchvision when installed (auto), or bench/vision_models.py")
    p.add_argument("--steady-after", type=int, default=2,
                   help="steps left out of the steady-state throughput (as the Rust binaries' --steady-after)")
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"],
                   help="bf16-mixed: the forward pass and loss under torch.autocast(bfloat16), as the Rust binaries")
    p.add_argument("--channels-last", action="store_true", help="model and inputs in channels-last memory format")
    peers.add_peer_flags(p)
    p.add_argument("--describe", action="store_true",
                   help="print the model's parameter count and state_dict shapes as JSON, and exit (no data, no training)")
    p.add_argument("--forward", metavar="FILE",
                   help="load the model's state_dict and an input batch (`input`) from the .safetensors FILE, print "
                        "the eval-mode logits and the state_dict keys the file lacked or had beyond it as JSON, and exit")
    a = p.parse_args()
    device = torch.device(a.device)
    peers.check_peer(a, device)
    if a.max_steps < 1 or a.batch_size < 1:
        peers.usage_error("--max-steps and --batch-size must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    num_classes = a.num_classes or (10 if a.model == "cnn" else 1000)
    torch.manual_seed(a.seed)
    model, source = vision_models.build(a.model, num_classes, a.layouts)
    params = sum(p.numel() for p in model.parameters())
    if a.forward:
        tensors = vision_models.read_safetensors(a.forward)
        inputs = tensors.pop("input")
        result = model.load_state_dict(tensors, strict=False)
        model.eval()
        with torch.no_grad():
            logits = model(inputs)
        print(json.dumps({"model": a.model, "layouts": source, "missing": result.missing_keys,
                          "unexpected": result.unexpected_keys, "logits": logits.tolist()}))
        return
    if a.describe:
        print(json.dumps({"model": a.model, "params": params, "layouts": source,
                          "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()}}))
        return

    if a.loader == "imagefolder":
        images = labels = None
        generated = os.path.exists(os.path.join(a.data_dir, "GENERATED.txt"))
    else:
        images, labels, generated = read_cifar10_train(a.data_dir)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the Rust binary sets it
    model = model.to(device)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=a.lr, **peers.optimizer_kwargs(a, capturable=True))
    forward = torch.compile(model, mode=a.compile) if a.compile else model
    # A captured step may not keep autocast's cache of cast weights across the capture's end.
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16-mixed",
                                      cache_enabled=False if a.cuda_graph else None)
    if a.loader == "memory":
        loader = MemoryLoader(images, labels, a.batch_size, a.seed, device)
    elif a.loader == "imagefolder":
        loader = ImageFolderLoader(a.data_dir, a.image_size, a.batch_size, a.seed, device, a.workers, a.prefetch)
    else:
        loader = DataLoaderLoader(images, labels, a.batch_size, a.seed, device, a.workers, a.prefetch)

    def train_step(inputs, targets, backward_done, set_to_none=True):
        """Forward, loss, arg-max hits, backward, update (common/src/train/mod.rs's optimizer_step)."""
        with autocast():
            logits = forward(inputs)
            loss = F.cross_entropy(logits, targets)
        hits = logits.argmax(-1).eq(targets).sum()
        optimizer.zero_grad(set_to_none=set_to_none)
        loss.backward()
        backward_done()
        optimizer.step()
        return loss.detach(), hits

    graphed = peers.GraphedStep(train_step, optimizer) if a.cuda_graph else None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock = peers.StepClock(device)
    # The step's loss and hits stay on the device (no host synchronisation per step).
    step_losses = torch.zeros(a.max_steps, dtype=torch.float64, device=device)
    step_hits = torch.zeros(a.max_steps, dtype=torch.int64, device=device)
    batch_sizes = []
    train_time = 0.0
    step, epoch = 0, 0
    # Steady state as the Rust loop measures it: from one step's end to the next one's within
    # an epoch, after the first --steady-after steps.
    steady_s, steady_images, steady_steps = 0.0, 0, 0
    while step < a.max_steps:
        torch.manual_seed(a.seed + epoch)  # dropout stream per epoch, as the Rust loop seeds it
        epoch_start = time.perf_counter()
        batches = loader.epoch(epoch)
        last_end = None
        while step < a.max_steps:
            clock.begin()
            batch = next(batches, None)
            if batch is None:
                clock.discard()
                break
            inputs, targets = batch
            inputs = inputs.contiguous(memory_format=fmt)
            clock.mark()
            if a.compile == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier graph outputs may be overwritten
            if graphed:
                loss, hits, kind = graphed(inputs, targets, clock)
            else:
                loss, hits = train_step(inputs, targets, clock.mark)
                kind = "eager"
            step_losses[step] = loss
            step_hits[step] = hits
            clock.end(kind)
            sync()  # once per step, after the optimizer: where the Rust loop waits for the device
            end = time.perf_counter()
            batch_sizes.append(len(targets))
            step += 1
            if step > a.steady_after and last_end is not None:
                steady_s += end - last_end
                steady_images += len(targets)
                steady_steps += 1
            last_end = end
        batches.close()  # shuts a DataLoader's workers down, as the Rust loop drops its loader
        train_time += time.perf_counter() - epoch_start
        epoch += 1

    losses = step_losses[:step].tolist()
    peers.finite_or_exit(f"exercise1_reference {a.model}", losses)
    seen = sum(batch_sizes)
    print(json.dumps({
        "impl": "pytorch", "exercise": "exercise1", "model": a.model, "params": params, "layouts": source,
        "device": a.device, "threads": torch.get_num_threads(), "loader": a.loader,
        "workers": a.workers if a.loader != "memory" else 0, "batch_size": a.batch_size,
        "steps": step, "images": seen, "examples_per_step": seen / step, "unit": "images/s",
        "train_time_s": train_time, "images_per_s": seen / train_time,
        "steady_throughput": steady_images / steady_s if steady_steps else None, "steady_steps": steady_steps,
        "precision": a.precision, "channels_last": a.channels_last, "compile": a.compile, "cuda_graph": a.cuda_graph,
        "optimizer": "adam", "optimizer_impl": peers.describe_optimizer(optimizer), "lr": a.lr,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "phase_clock": "cuda events" if device.type == "cuda" else "host", **clock.phases(),
        "step_losses": losses, "last_loss": losses[-1],
        "train_loss": sum(l * n for l, n in zip(losses, batch_sizes)) / seen, "train_acc": step_hits[:step].sum().item() / seen,
        "generated_data": generated, "torch_version": torch.__version__,
    }))


if __name__ == "__main__":
    main()
