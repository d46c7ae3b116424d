#!/usr/bin/env python3
"""PyTorch reference for exercise1_nlp and its peers: the course's Transformer tutorial model and
training step, same configuration flags as the Rust binary, reporting training tokens/s.

    python bench/exercise1_nlp_reference.py --data-dir data/wikitext-2 --max-steps 50 --threads 2
    python bench/exercise1_nlp_reference.py --device cuda --fused --cuda-graph

Prints one JSON line: {"impl": "pytorch", "steady_throughput": ..., "steps": ..., "step_losses": [...], ...}.
The recipe is exercise1_nlp's default: SGD lr 5 (no momentum), gradient-norm clipping 0.5,
batch 20 x bptt 35. The peers (bench/peers.py): SGD's default implementation or --fused,
--compile [default|reduce-overhead], --cuda-graph; a peer that does not exist on the device
is refused with one line (exit 2). Timed as the Rust training loop (common/src/train/mod.rs):
one device synchronisation per step, after the optimizer; the steady state from one step's end
to the next one's after --steady-after steps; each step split into data (slicing the batch),
forward+backward and optimizer (clipping and the step), from CUDA events on a GPU and host
clocks on the CPU. The run exits 1 when a step's loss is not finite.
"""
import argparse, json, os, re, time, warnings

import torch
from torch import nn

import peers
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
    p.add_argument("--clip", type=float, default=0.5, help="gradient-norm clipping threshold; 0 turns it off (exercise1_nlp's --clip)")
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--steady-after", type=int, default=2,
                   help="steps left out of the steady-state throughput (as the Rust binaries' --steady-after)")
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"],
                   help="bf16-mixed: the forward pass and loss under torch.autocast(bfloat16), as the Rust binary")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=42)
    peers.add_peer_flags(p)
    a = p.parse_args()
    device = torch.device(a.device)
    peers.check_peer(a, device)
    if a.max_steps < 1 or a.clip < 0:
        peers.usage_error("--max-steps must be at least 1 and --clip not negative")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    tokens = load_tokens(a.data_dir, a.train_split, a.tokenizer)
    generated = os.path.exists(os.path.join(a.data_dir, "GENERATED.txt"))
    vocab = {"<unk>": 0} if a.tokenizer == "basic_english" else {}
    for w in tokens:
        vocab.setdefault(w, len(vocab))
    data = torch.tensor([vocab[w] for w in tokens], dtype=torch.long)
    nbatch = data.size(0) // a.batch_size
    data = data[: nbatch * a.batch_size].view(a.batch_size, -1).t().contiguous().to(device)
    if data.size(0) < a.bptt + 2:
        raise SystemExit(f"error: {a.data_dir}: {data.size(0)} tokens per stream, fewer than --bptt {a.bptt} + 2")

    model = TransformerModel(len(vocab), a.emsize, a.nhead, a.d_hid, a.nlayers, a.dropout).to(device)
    criterion = nn.CrossEntropyLoss()
    # exercise1_nlp's recipe (TUTORIAL_RECIPE in common/src/presets.rs): SGD lr 5 without
    # momentum, gradients clipped to norm 0.5; its StepLR changes the rate between epochs only.
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, **peers.optimizer_kwargs(a))
    forward = torch.compile(model, mode=a.compile) if a.compile else model
    mask = nn.Transformer.generate_square_subsequent_mask(a.bptt).to(device)
    model.train()
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16-mixed",
                                      cache_enabled=False if a.cuda_graph else None)

    def train_step(src, tgt, backward_done, set_to_none=True):
        with autocast():
            # is_causal=True: what the encoder would conclude from comparing the mask with a causal
            # one on the host, a device synchronisation every forward (see tutorial_transformer.py).
            output = forward(src, mask, is_causal=True)
            loss = criterion(output.view(-1, len(vocab)), tgt)
        optimizer.zero_grad(set_to_none=set_to_none)
        loss.backward()
        backward_done()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        optimizer.step()
        return loss.detach(), None

    graphed = peers.GraphedStep(train_step, optimizer) if a.cuda_graph else None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # As common/src/train/mod.rs: one synchronisation per step, after the optimizer; the steady
    # state from one step's end to the next one's after --steady-after steps; each step split
    # into data (slicing the batch), forward+backward and optimizer (clipping and the step); the
    # losses kept on the device.
    clock = peers.StepClock(device)
    step_losses = torch.zeros(a.max_steps, dtype=torch.float64, device=device)
    steps, i = 0, 0
    steady_s, steady_tokens, steady_steps, last_end = 0.0, 0, 0, None
    started = time.perf_counter()
    while steps < a.max_steps:
        clock.begin()
        if i >= data.size(0) - 1 - a.bptt:
            i = 0
        src, tgt = data[i : i + a.bptt], data[i + 1 : i + 1 + a.bptt].reshape(-1)
        i += a.bptt
        clock.mark()
        if a.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier graph outputs may be overwritten
        if graphed:
            loss, _, kind = graphed(src, tgt, clock)
        else:
            loss, _ = train_step(src, tgt, clock.mark)
            kind = "eager"
        step_losses[steps] = loss
        clock.end(kind)
        sync()
        end = time.perf_counter()
        steps += 1
        if steps > a.steady_after and last_end is not None:
            steady_s += end - last_end
            steady_tokens += tgt.numel()
            steady_steps += 1
        last_end = end
    train_time = time.perf_counter() - started
    losses = step_losses.tolist()
    peers.finite_or_exit("exercise1_nlp_reference", losses)
    params = sum(p.numel() for p in model.parameters())
    tokens_per_step = a.bptt * a.batch_size
    print(json.dumps({"impl": "pytorch", "exercise": "exercise1_nlp", "model": "transformer", "unit": "tokens/s",
                      "steps": steps, "examples_per_step": tokens_per_step, "train_time_s": train_time,
                      "tokens_per_s": steps * tokens_per_step / train_time,
                      "steady_throughput": steady_tokens / steady_s if steady_steps else None, "steady_steps": steady_steps,
                      "phase_clock": "cuda events" if device.type == "cuda" else "host", **clock.phases(),
                      "generated_data": generated, "precision": a.precision, "compile": a.compile, "cuda_graph": a.cuda_graph,
                      "optimizer": "sgd", "optimizer_impl": peers.describe_optimizer(optimizer), "lr": a.lr, "clip": a.clip,
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "params": params, "vocab": len(vocab),
                      "step_losses": losses, "last_loss": losses[-1], "threads": torch.get_num_threads(),
                      "torch_version": torch.__version__, "device": a.device}))


if __name__ == "__main__":
    main()
