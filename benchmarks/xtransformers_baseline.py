"""The PyTorch baseline for benchmarks/train_throughput.py: x-transformers on the same shape.

Run by train_throughput.py with `--xtransformers PYTHON` (a Python that has torch and
x-transformers; never a dependency of posattn). Prints one JSON line: tokens/s and ms per step of a
decoder-only LM training step (AdamW, gradient clipping) on random bytes.

With --products M:IxO,IxO,... (train_throughput.py passes the posattn step's dense products), also
"matmul_ms": those products alone in torch, forward x W, dX = dY W^T and dW = X^T dY of each (X
[M, I], W [I, O]), best of three calls after one untimed, timed right after the step's window as
posattn's "matmuls alone" are: the same work in torch's GEMM library.

    /path/to/torch/python benchmarks/xtransformers_baseline.py --d_model 128 --layers 4 --heads 4 \
        --seq_len 256 --batch 16 --position rope
"""

import argparse
import json
import time

import torch
from x_transformers import Decoder, TransformerWrapper


def products_ms(spec: str) -> float:
    """Best ms of three calls of every product in `spec` ("M:IxO,IxO,...") in its three forms."""
    rows, shapes = spec.split(":")
    m = int(rows)
    operands = []
    for shape in shapes.split(","):
        i, o = (int(n) for n in shape.split("x"))
        operands.append((torch.randn(m, i), torch.randn(i, o), torch.randn(m, o)))

    def gemms():
        return [(x @ w, dy @ w.T, x.T @ dy) for x, w, dy in operands]

    gemms()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        gemms()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--position", default="rope", choices=["rope", "alibi", "learned", "nope"])
    p.add_argument("--products", default="", help="M:IxO,IxO,... products to time alone")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    # The same shape as posattn's: heads of d_model / heads (x-transformers' default is 64 per head
    # whatever the width, which at d_model 128 and 4 heads would double the attention's width) and
    # RoPE on the whole head (its default rotates half of it).
    dim_head = a.d_model // a.heads
    kwargs = {
        "rope": dict(rotary_pos_emb=True, rotary_emb_dim=dim_head),
        "alibi": dict(alibi_pos_bias=True, alibi_num_heads=a.heads),
        "learned": {},
        "nope": {},
    }[a.position]
    model = TransformerWrapper(
        num_tokens=256,
        max_seq_len=a.seq_len,
        use_abs_pos_emb=a.position == "learned",
        attn_layers=Decoder(
            dim=a.d_model,
            depth=a.layers,
            heads=a.heads,
            attn_dim_head=dim_head,
            ff_mult=4,
            **kwargs,
        ),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, 256, (a.batch, a.seq_len + 1))

    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    ms = (time.perf_counter() - start) / a.steps * 1e3
    extra = {"matmul_ms": products_ms(a.products)} if a.products else {}
    print(
        json.dumps(
            {
                **extra,
                "ms_per_step": ms,
                "tokens_per_sec": a.batch * a.seq_len / ms * 1e3,
                "parameters": sum(p.numel() for p in model.parameters()),
                "torch": torch.__version__,
                "threads": a.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
