#!/usr/bin/env python3
"""PyTorch eager reference for exercise1_nlp: the course's Transformer tutorial model and
training step, same configuration flags as the Rust binary, reporting training tokens/s.

    python bench/exercise1_nlp_reference.py --data-dir data/wikitext-2 --max-steps 50 --threads 2

Prints one JSON line: {"impl": "pytorch", "tokens_per_s": ..., "steps": ..., ...}.
Timed as the Rust training loop (common/src/train.rs) times an epoch: one clock over all steps
(tokens / that time = the Rust JSON's `throughput`), each step split into data (slicing the
batch), forward+backward and optimizer (clipping and the step).
"""
import argparse, json, os, re, time, warnings

import torch
from torch import nn

from tutorial_transformer import TransformerModel

# The tutorial's batch_first=False layers make nn.TransformerEncoder warn about nested tensors.
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")

_PATTERNS = [(r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "),
             (r"\(", " ( "), (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "),
             (r"\:", " "), (r"\s+", " ")]
_COMPILED = [(re.compile(p), r) for p, r in _PATTERNS]


def basic_english(line):
    """torchtext's get_tokenizer('basic_english')."""
    line = line.lower()
    for pattern, repl in _COMPILED:
        line = pattern.sub(repl, line)
    return line.split()


def split_path(data_dir, split):
    for name in (f"wiki.{split}.tokens", f"{split}.txt", f"wikitext-2/wiki.{split}.tokens"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"error: no {split} split in {data_dir}")


def load_tokens(data_dir, split, tokenizer):
    with open(split_path(data_dir, split), encoding="utf8") as f:
        lines = f.readlines()
    if tokenizer == "whitespace":
        return [w for line in lines for w in line.split() + ["<eos>"]]
    return [w for line in lines for w in basic_english(line)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data/wikitext-2")
    p.add_argument("--train-split", default="train", help="split to train on (valid where train is absent)")
    p.add_argument("--tokenizer", default="basic_english", choices=["basic_english", "whitespace"])
    p.add_argument("--emsize", type=int, default=1024)
    p.add_argument("--d-hid", type=int, default=1024)
    p.add_argument("--nhead", type=int, default=4)
    p.add_argument("--nlayers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=5.0)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=0, help="untimed first steps (the Rust loop times every step)")
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"],
                   help="bf16-mixed: the forward pass and loss under torch.autocast(bfloat16), as the Rust binary")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)

    tokens = load_tokens(a.data_dir, a.train_split, a.tokenizer)
    generated = os.path.exists(os.path.join(a.data_dir, "GENERATED.txt"))
    vocab = {"<unk>": 0} if a.tokenizer == "basic_english" else {}
    for w in tokens:
        vocab.setdefault(w, len(vocab))
    data = torch.tensor([vocab[w] for w in tokens], dtype=torch.long)
    nbatch = data.size(0) // a.batch_size
    data = data[: nbatch * a.batch_size].view(a.batch_size, -1).t().contiguous().to(device)

    model = TransformerModel(len(vocab), a.emsize, a.nhead, a.d_hid, a.nlayers, a.dropout).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr)
    mask = nn.Transformer.generate_square_subsequent_mask(a.bptt).to(device)
    model.train()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # As common/src/train.rs: one clock over the whole loop (the Rust epoch clock; started
    # after --warmup untimed steps), and each step split into data (slicing the batch),
    # forward+backward and optimizer (clipping and the step); the loss is summed on the
    # device, with no host synchronisation per step.
    steps, tokens_timed = 0, 0
    data_wait = forward_backward = optimizer_time = 0.0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    i = 0
    sync()
    start = time.perf_counter()
    while steps < a.max_steps:
        if steps == a.warmup:
            sync()
            start = time.perf_counter()
        t0 = time.perf_counter()
        if i >= data.size(0) - 1 - a.bptt:
            i = 0
        src, tgt = data[i : i + a.bptt], data[i + 1 : i + 1 + a.bptt].reshape(-1)
        i += a.bptt
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16-mixed"):
            output = model(src, mask)
            loss = criterion(output.view(-1, len(vocab)), tgt)
        optimizer.zero_grad()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        sync()
        t3 = time.perf_counter()
        loss_sum += loss.detach().to(torch.float64) * tgt.numel()
        # The split covers every step, as the Rust results' does (the report divides it by all
        # steps); the throughput, the steps after --warmup.
        data_wait += t1 - t0
        forward_backward += t2 - t1
        optimizer_time += t3 - t2
        if steps >= a.warmup:
            tokens_timed += tgt.numel()
        steps += 1
    timed = time.perf_counter() - start
    loss_value = loss.item()
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"impl": "pytorch", "tokens_per_s": tokens_timed / timed, "steps": steps,
                      "train_time_s": timed, "data_wait_s": data_wait, "forward_backward_s": forward_backward,
                      "optimizer_s": optimizer_time, "generated_data": generated,
                      "timed_steps": steps - a.warmup,
                      "steady_throughput": tokens_timed / timed if steps > a.warmup else None, "precision": a.precision,
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "params": params, "vocab": len(vocab),
                      "last_loss": loss_value, "threads": torch.get_num_threads(),
                      "torch_version": torch.__version__, "device": a.device}))


if __name__ == "__main__":
    main()
