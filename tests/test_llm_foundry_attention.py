"""bench/llm_foundry_attention.py: llm-foundry's Triton attention rate from its own sequence sweeps (the F rows of
bench/plan_published.py take it), against the counts by hand and llm-foundry's own FLOP convention."""

from __future__ import annotations

import pytest
from bench_modules import bench_module


@pytest.fixture(scope="module")
def sweeps():
    return bench_module("llm_foundry_attention")


def test_traced_attention_flops_per_token(sweeps):
    # Causal flash SDPA as the model traces it: a head's forward 4 s^2 d, backward 10 s^2 d (five matmuls), at
    # half; the forward once more under checkpointing: 7 (9) x layers x d_model a token, per token of sequence.
    assert sweeps.attention_flops_per_token_per_seq("1b", checkpointing=False) == 7 * 24 * 2048
    assert sweeps.attention_flops_per_token_per_seq("7b", checkpointing=True) == 9 * 32 * 4096


def test_lines_and_shares(sweeps):
    lines = {(line.model, line.card): line for line in sweeps.sweep_lines()}
    h100_1b, h100_7b = lines["1b", "H100-80GB"], lines["7b", "H100-80GB"]
    assert h100_1b.seqs == (8192, 16384, 32768) and not h100_1b.checkpointing
    assert h100_7b.seqs == (8192, 32768, 65536) and h100_7b.checkpointing  # no 16k row on the H100
    assert all(line.r2 > 0.999 for line in lines.values())
    # In llm-foundry's MFU convention (the whole s x s square, 3x the forward: 12 x layers x d_model) the slopes
    # give the figures bench/README.md quotes: 297 and 246 TFLOP/s on an H100, 166 and 134 on an A100.
    for (model, card), figure in {
        ("1b", "H100-80GB"): 297,
        ("7b", "H100-80GB"): 246,
        ("1b", "A100-80GB"): 166,
        ("7b", "A100-80GB"): 134,
    }.items():
        layers, width = {"1b": (24, 2048), "7b": (32, 4096)}[model]
        assert 12 * layers * width / lines[model, card].slope / 1e12 == pytest.approx(figure, abs=1)
    shares = sweeps.card_shares()
    assert set(shares) == {"H100-80GB", "A100-80GB", "A100-40GB"}
    assert all(0.5 < share < 0.54 for share in shares.values())


def test_bench_rows_left_out(sweeps):
    with_row = {(line.model, line.card): line for line in sweeps.sweep_lines()}
    without = {(line.model, line.card): line for line in sweeps.sweep_lines([("7b", "H100-80GB", 8192, 8, 2)])}
    assert without["7b", "H100-80GB"].seqs == (32768, 65536)
    assert without["7b", "H100-80GB"].left_out == (8192,)
    assert with_row["1b", "H100-80GB"] == without["1b", "H100-80GB"]
