"""The traced step's FLOPs: grouped-query attention counted as its kernel computes it, on any torch release."""

from __future__ import annotations

import pytest
import torch
from torch.utils import flop_counter

from autotune.estimate.step_costs import counted_flops

# Llama-3's grouping: 4 query heads to each key/value head.
QUERY, KEY_VALUE, OUT = (2, 32, 256, 128), (2, 8, 256, 128), (2, 32, 256, 128)


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=torch.bfloat16)


@flop_counter.shape_wrapper
def _equal_heads_only(query, key, value, *args, out_shape=None, **kwargs):
    """An attention formula as torch 2.11 wrote it: the key's heads must be the query's."""
    assert query[1] == key[1], "sdpa_flop_count: query/key/value shapes are incompatible"
    return flop_counter.sdpa_flop_count(query, key, value)


def test_grouped_query_attention_counts_each_query_head_against_its_group():
    q, k, v = _meta(QUERY), _meta(KEY_VALUE), _meta(KEY_VALUE)
    repeated = flop_counter.sdpa_flop_count(QUERY, QUERY, QUERY)  # the key and value repeated to 32 heads
    # A release whose formula refuses the grouped shapes is given the repeated heads...
    assert counted_flops(_equal_heads_only, (q, k, v), {}, None) == repeated
    # ...and a release whose formula counts grouped heads itself is called as it is, with the same figure.
    native = flop_counter.flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
    assert counted_flops(native, (q, k, v), {}, (_meta(OUT),)) == repeated


def test_a_formula_refusing_shapes_that_are_not_grouped_heads_still_refuses():
    q, k = _meta(QUERY), _meta((2, 12, 256, 128))  # 32 heads are no whole number of groups of 12
    with pytest.raises(AssertionError):
        counted_flops(_equal_heads_only, (q, k, k), {}, None)
