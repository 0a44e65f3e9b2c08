"""How fast a card runs a Llama's own matrix products, shape by shape, against the step-time model's one
figure for all of them (a share of the card's published bf16 peak, `autotune.estimate.step_time`).

On a GPU machine:   python bench/gpu_matmuls.py [--config bench/data/published/llama-3.2-3b.json]

For each linear layer of the model (q, k, v, o, the MLP's three, the LM head) and a few token counts per
micro batch, it times the forward product and the two backward ones (bf16, 20 timed after 5 warm-ups,
CUDA events) and prints the TFLOP/s each sustains, and the share of the card's peak from
`autotune.config.gpus`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOKENS = (1024, 2048, 4096, 8192)


def main() -> None:
    import torch

    from autotune.config.gpus import gpu_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("bench/data/published/llama-3.2-3b.json"))
    parser.add_argument("--card", help="the card's name in autotune (default: H200 or H100-80GB, by the device's name)")
    args = parser.parse_args()
    cfg = json.loads(args.config.read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    layers = {"q/o": (hidden, hidden), "k/v": (hidden, kv), "gate/up": (hidden, inter), "down": (inter, hidden)}
    layers["lm head"] = (hidden, vocab)
    name_here = torch.cuda.get_device_name(0)
    card = args.card or ("H200" if "H200" in name_here else "H100-80GB" if "H100" in name_here else None)
    peak = gpu_spec(card).bf16_flops if card else None
    print(f"# python bench/gpu_matmuls.py --config {args.config}: {torch.cuda.get_device_name(0)}")
    print("layer (in x out) | tokens | forward TFLOP/s | backward (both) TFLOP/s | share of the published peak")
    print(f"peak: {card or 'card unknown'} {peak / 1e12 if peak else 0:.0f} TFLOP/s bf16 dense")
    for name, (n_in, n_out) in layers.items():
        for tokens in TOKENS:
            x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * n_in * n_out
            forward = _tflops(lambda x=x, w=w: x @ w.t(), flops)
            backward = _tflops(lambda x=x, w=w, dy=dy: (dy @ w, dy.t() @ x), 2 * flops)
            share = f"{forward * 1e12 / peak:.0%} / {backward * 1e12 / peak:.0%}" if peak else "-"
            print(f"{name} ({n_in} x {n_out}) | {tokens} | {forward:.0f} | {backward:.0f} | {share}")


def _tflops(run, flops: float) -> float:
    import torch

    for _ in range(5):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        run()
    end.record()
    torch.cuda.synchronize()
    return flops * 20 / (start.elapsed_time(end) / 1e3) / 1e12


if __name__ == "__main__":
    main()
