"""PyTorch references for common/tests/transformer.rs.

Usage: transformer_parity.py {layer,model,train} OUT.npz

The model is the one of PyTorch's tutorial "Language modeling with nn.Transformer"
(TransformerModel, PositionalEncoding), from bench/tutorial_transformer.py. All tensors are written with their torch
names; floats are float32, token ids int64.

layer: one nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1) in eval mode, its parameters
    perturbed so that no bias is 0 and no norm weight 1, on x [10, 3, 32] with the causal mask:
    param.<name>          the layer's parameters
    x                     the input [seq, batch, d]
    out.causal_hint       layer(x, src_mask=mask, is_causal=True): how nn.TransformerEncoder calls
                          it for a causal mask (sdpa with is_causal=True)
    out.float_mask        layer(x, src_mask=mask): sdpa with the additive -inf mask
    out.fastpath          a batch_first=True copy under no_grad, on x transposed: eval mode's fused
                          torch._transformer_encoder_layer_fwd (the script checks that it ran)
    out.no_fastpath       the same with torch.backends.mha.set_fastpath_enabled(False)

model: TransformerModel(V=50, d=32, nhead=4, d_hid=64, nlayers=2, dropout=0.2) in eval mode,
    parameters perturbed likewise:
    param.<name>          every parameter
    buffer.pos_encoder.pe the positional encoding buffer [5000, 1, 32]
    src                   token ids [12, 5]
    logits                model(src) [12, 5, 50]

train: the same model with the tutorial's initialisation, trained in train mode for 10 steps
    as the course does: SGD lr 5.0, clip_grad_norm_(model.parameters(), 0.5), cross-entropy of
    output.view(-1, V) against the next tokens; once with dropout 0.0 (`plain`, deterministic)
    and once, from the same weights, with dropout 0.2 (`dropout`), torch.manual_seed(1) before
    each run:
    param.<name>          initial parameters
    order.<name>          the parameter's index in model.parameters() (0-dim int64)
    data                  batchified token stream [81, 4]; step i reads rows 8i..8i+8 as input
                          and rows 8i+1..8i+9 (flattened) as targets
    loss.<run>            [10] each step's loss, before its update
    grad_norm.<run>       [10] clip_grad_norm_'s result per step
    final.<run>.<name>    the parameters after the 10 updates
"""

import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

SEED = 0
V, D_MODEL, NHEAD, D_HID, NLAYERS = 50, 32, 4, 64, 2
STEPS, BPTT, BATCH, LR, MAX_NORM = 10, 8, 4, 5.0, 0.5
DROPOUT, TRAIN_SEED = 0.2, 1

# nn.TransformerEncoder warns that nested tensors need batch_first=True, as in the tutorial.
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")


# --- the tutorial's model, shared with the benchmark --------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from tutorial_transformer import PositionalEncoding, TransformerModel  # noqa: E402


# --- helpers ------------------------------------------------------------------------------------
def perturb(module):
    """Moves every parameter away from its initial value, so that a zero bias or a unit norm
    weight cannot hide a parameter loaded under the wrong name."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))


def params(module, prefix="param."):
    return {f"{prefix}{n}": p.detach().numpy().copy() for n, p in module.named_parameters()}


def layer_reference():
    layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, D_HID, dropout=0.1)
    perturb(layer)
    layer.eval()
    x = torch.randn(10, 3, D_MODEL)
    mask = nn.Transformer.generate_square_subsequent_mask(x.size(0))
    arrays = {**params(layer), "x": x.numpy()}
    with torch.no_grad():
        arrays["out.causal_hint"] = layer(x, src_mask=mask, is_causal=True).numpy()
        arrays["out.float_mask"] = layer(x, src_mask=mask).numpy()

    # The fast path needs batch_first=True; count its calls to be sure it is what ran.
    fused = torch._transformer_encoder_layer_fwd
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    torch._transformer_encoder_layer_fwd = counting
    try:
        layer_bf = nn.TransformerEncoderLayer(D_MODEL, NHEAD, D_HID, dropout=0.1, batch_first=True)
        layer_bf.load_state_dict(layer.state_dict())
        layer_bf.eval()
        x_bf = x.transpose(0, 1)
        with torch.no_grad():
            out = layer_bf(x_bf, src_mask=mask, is_causal=True)
            assert len(calls) == 1, "the eval-mode fast path did not run"
            arrays["out.fastpath"] = out.transpose(0, 1).contiguous().numpy()
            torch.backends.mha.set_fastpath_enabled(False)
            out = layer_bf(x_bf, src_mask=mask, is_causal=True)
            assert len(calls) == 1, "the fast path ran although disabled"
            arrays["out.no_fastpath"] = out.transpose(0, 1).contiguous().numpy()
    finally:
        torch._transformer_encoder_layer_fwd = fused
        torch.backends.mha.set_fastpath_enabled(True)
    return arrays


def model_reference():
    model = TransformerModel(V, D_MODEL, NHEAD, D_HID, NLAYERS, dropout=0.2)
    perturb(model)
    model.eval()
    src = torch.randint(V, (12, 5))
    with torch.no_grad():
        logits = model(src)
    return {
        **params(model),
        "buffer.pos_encoder.pe": model.pos_encoder.pe.numpy(),
        "src": src.numpy(),
        "logits": logits.numpy(),
    }


def token_stream(n):
    """Tokens that mostly follow a fixed rule (next = 7·prev + 3 mod V), so that training learns."""
    tokens = [int(torch.randint(V, ()))]
    noise = torch.rand(n) < 0.2
    random = torch.randint(V, (n,))
    for i in range(1, n):
        tokens.append(int(random[i]) if noise[i] else (7 * tokens[-1] + 3) % V)
    return torch.tensor(tokens)


def train(model, data):
    """The course's training steps; returns the per-step losses and gradient norms."""
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses, norms = [], []
    for step in range(STEPS):
        i = step * BPTT
        inputs, targets = data[i : i + BPTT], data[i + 1 : i + 1 + BPTT].reshape(-1)
        optimizer.zero_grad()
        output = model(inputs)
        loss = criterion(output.view(-1, V), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses, dtype=np.float32), np.array(norms, dtype=np.float32)


def train_reference():
    model = TransformerModel(V, D_MODEL, NHEAD, D_HID, NLAYERS, dropout=0.0)
    arrays = params(model)
    for i, (n, _) in enumerate(model.named_parameters()):
        arrays[f"order.{n}"] = np.array(i, dtype=np.int64)
    # The tutorial's batchify: one stream cut into BATCH columns.
    rows = STEPS * BPTT + 1
    data = token_stream(rows * BATCH).view(BATCH, rows).t().contiguous()
    arrays["data"] = data.numpy()

    # The same start with dropout: the model's variant has no parameters of its own.
    with_dropout = TransformerModel(V, D_MODEL, NHEAD, D_HID, NLAYERS, dropout=DROPOUT)
    with_dropout.load_state_dict(model.state_dict())
    for name, m in {"plain": model, "dropout": with_dropout}.items():
        # Seeded just before training: the Rust side seeds LibTorch's generator (the same one)
        # with the same value and draws the same dropout masks, in the same order.
        torch.manual_seed(TRAIN_SEED)
        arrays[f"loss.{name}"], arrays[f"grad_norm.{name}"] = train(m, data)
        arrays.update(params(m, prefix=f"final.{name}."))
    return arrays


PARTS = {"layer": layer_reference, "model": model_reference, "train": train_reference}


def main(part, out_path):
    torch.manual_seed(SEED)
    arrays = PARTS[part]()
    for name, a in arrays.items():
        assert a.dtype in (np.float32, np.int64), (name, a.dtype)
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in PARTS:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
