"""find --plan: every config of a space predicted to fit a card, ranked by predicted throughput, nothing run."""

from __future__ import annotations

import json
from dataclasses import replace

import commands
import pytest

from autotune.config.workload import Workload
from autotune.search.plan import PLAN_ERROR, plan_space

SPACE = "knobs:\n  micro_batch: [1, 2, 4, 8, 16, 32]\n  precision: [fp32, bf16]\n  checkpointing: [false, true]\n"
WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=32, gpu="A100-80GB")


def test_a_plan_ranks_what_fits_and_marks_the_configs_to_verify_first(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    plan = plan_space(workload=WORKLOAD, space=str(tmp_path / "space.yaml"), memory_budget_bytes=2**30)
    rates = [row.step.samples_per_s for row in plan.rows]
    assert rates == sorted(rates, reverse=True) and len(plan.rows) + plan.too_big == 24
    assert all(row.memory_bytes <= plan.limit_bytes for row in plan.rows)
    assert all(row.device_bytes > row.memory_bytes for row in plan.rows)  # the context, beyond the allocator
    top = rates[0]
    assert [row.verify_first for row in plan.rows] == [rate >= top * (1 - PLAN_ERROR) for rate in rates]
    assert plan.rows[0].verify_first and plan.estimates < 24  # families bisected, not every config estimated
    # A smaller budget: the largest micro batches no longer fit; what is left fits under it.
    small = plan_space(workload=WORKLOAD, space=str(tmp_path / "space.yaml"), memory_budget_bytes=300 * 2**20)
    assert small.too_big > plan.too_big and all(row.memory_bytes <= small.limit_bytes for row in small.rows)


@pytest.mark.slow
def test_find_plan_prints_its_table_and_json_without_running_anything(tmp_path):
    # Two configs, one family: what is tested here is the command's output; the ranking of a whole
    # space is the test above's (each family costs the command seconds of tracing, twice).
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  precision: [bf16]\n")
    args = [
        "find",
        "--plan",
        "--device",
        "cuda",
        "--gpu",
        "H100-80GB",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "256",
        "--global-batch",
        "32",
        "--space",
        str(tmp_path / "space.yaml"),
    ]
    table = commands.autotune(*args, timeout=600, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "plan for builtin:llama-tiny on 1 x H100-80GB (nothing was run)" in table.stdout
    assert "verify first" in table.stdout and "tokens/s per GPU" in table.stdout
    data = json.loads(commands.autotune(*args, "--json", timeout=600, cwd=tmp_path).stdout)
    assert data["device"] == "H100-80GB" and data["rows"][0]["verify_first"]
    assert {"tokens_per_s", "mfu", "memory_bytes", "device_bytes", "headroom_bytes"} <= set(data["rows"][0])
    assert not (tmp_path / "storage").exists()  # no study: nothing was measured


# -- the plan's rules, on the toy CPU of tests/step_toys.py with an exact estimator (nothing traced) ----------
MiB = 2**20


def _toy_plan(tmp_path, knobs: str, states_mib, asked: list, twin=None, looked_ahead=None):
    """A plan of ``knobs`` under a 50 MiB limit: ``states_mib(config)`` of model states, and 4 MiB a sample
    (1.5 with checkpointing), exactly; every estimate asked for is appended to ``asked``."""
    from step_toys import toy_costs

    from autotune.estimate.results import MemoryEstimate

    (tmp_path / "space.yaml").write_text("knobs:\n" + knobs)
    looked_ahead = [] if looked_ahead is None else looked_ahead

    def estimate(config, ahead=()):
        asked.append(config)
        looked_ahead.append((config, list(ahead)))
        states = int(states_mib(config) * MiB)
        activations = int(config.micro_batch * (1.5 if config.checkpointing else 4) * MiB)
        return MemoryEstimate(
            config=config,
            predicted_peak_bytes=states + activations,
            parameters_bytes=states // 4,
            gradients_bytes=states // 4,
            optimizer_state_bytes=states - 2 * (states // 4),
            activations_bytes=activations,
            temporaries_bytes=0,
            overhead_bytes=None,
            method="test",
            seconds=0.0,
            step_costs=toy_costs(100),
        )

    return _planned_on_a_toy_cpu(tmp_path / "space.yaml", estimate, twin=twin)


def _planned_on_a_toy_cpu(space, estimate, *, profile=None, twin=None):
    """The plan of the space file ``space`` under a 50 MiB limit on the toy CPU of tests/step_toys.py (or
    ``profile``), for a global batch of 32, with ``estimate`` as its estimator."""
    from step_toys import TOY_CPU

    from autotune.config.device import DeviceInfo
    from autotune.search.plan import plan
    from autotune.search.presets import load_space

    return plan(
        workload=Workload(global_batch=32),
        space=load_space(str(space)),
        profile=profile or TOY_CPU,
        device=DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False),
        limit_bytes=50 * MiB,
        memory_budget_bytes=55 * MiB,
        estimator=estimate,
        twin=twin,
    )


SIZES = "  micro_batch: [1, 2, 4, 8, 16, 32]\n  checkpointing: [false, true]\n"


def test_each_family_is_traced_once_and_again_only_where_its_line_comes_near_the_limit(tmp_path):
    asked: list = []
    result = _toy_plan(tmp_path, SIZES, lambda config: 4, asked)
    plain = [c.micro_batch for c in asked if not c.checkpointing]
    checkpointed = [c.micro_batch for c in asked if c.checkpointing]
    # Plain: mb=4 (20 MiB) is the one estimate; its line puts mb=8 at 36 MiB and mb=16 at 68, both far from 50.
    assert plain == [4]
    # Checkpointed: mb=4 (10 MiB); the line puts mb=32 at 52 MiB, within 5% of the limit: estimated itself.
    assert checkpointed == [4, 32]
    fitting = {(row.config.checkpointing, row.config.micro_batch) for row in result.rows}
    assert fitting == {(False, mb) for mb in (1, 2, 4, 8)} | {(True, mb) for mb in (1, 2, 4, 8, 16)}
    assert result.too_big == 3 and result.estimates == 3
    assert {row.config.micro_batch for row in result.rows if row.estimated} == {4}  # the rest: the line's


def test_a_family_whose_model_states_alone_are_over_the_limit_is_not_traced_again(tmp_path):
    # fp32 holds 60 MiB of states here, over the 50 MiB limit whatever the micro batch or checkpointing: once one
    # fp32 family's estimate says so, the other fp32 family (the same states) is not traced.
    asked: list = []
    knobs = SIZES + "  precision: [bf16, fp32]\n"
    result = _toy_plan(tmp_path, knobs, lambda config: 60 if config.precision == "fp32" else 4, asked)
    fp32_families = {c.checkpointing for c in asked if c.precision == "fp32"}
    assert len(fp32_families) == 1 and result.states_over == 1
    assert not [row for row in result.rows if row.config.precision == "fp32"] and result.too_big == 3 + 12


def test_fused_adamw_holds_the_states_of_the_default_one_so_it_is_not_traced_where_those_are_over(tmp_path):
    # Fused AdamW keeps the same moments: once unfused fp32 is over the limit, no fused fp32 family is traced.
    asked: list = []
    knobs = SIZES + "  precision: [bf16, fp32]\n  fused_optimizer: [false, true]\n"
    result = _toy_plan(tmp_path, knobs, lambda config: 60 if config.precision == "fp32" else 4, asked)
    assert [(c.fused_optimizer, c.checkpointing) for c in asked if c.precision == "fp32"] == [(False, False)]
    assert result.states_over == 3 and not [row for row in result.rows if row.config.precision == "fp32"]


def test_each_estimate_looks_ahead_to_the_families_the_plan_will_estimate_whatever_it_learns(tmp_path):
    # Families in order: bf16, bf16 ckpt, fp32, fp32 ckpt. Of a states twin not estimated yet only the first family is
    # certain to be estimated (fp32's finds its states over, and fp32 ckpt is then not traced at all).
    asked, looked_ahead = [], []
    knobs = SIZES + "  precision: [bf16, fp32]\n"
    _toy_plan(tmp_path, knobs, lambda config: 60 if config.precision == "fp32" else 4, asked, looked_ahead=looked_ahead)
    middles = {(c.precision, c.checkpointing): c for c, _ in looked_ahead if c.micro_batch == 4}
    ahead = {config: [(c.precision, c.checkpointing) for c in next_ones] for config, next_ones in looked_ahead}
    assert ahead[middles["bf16", False]] == [("fp32", False)]  # bf16 ckpt's twin is the one being estimated
    assert ahead[middles["bf16", True]] == [("fp32", False)]
    assert ahead[middles["fp32", False]] == []
    assert all(ahead == [] for config, ahead in looked_ahead if config.micro_batch != 4)  # a size near the limit


def test_twins_share_one_row_that_says_why_it_shows_the_one_it_shows(tmp_path):
    from autotune.search.plan import Twin

    asked: list = []
    knobs = SIZES + "  precision: [bf16, fp32]\n"
    twin = Twin(lambda c: c.replace(precision="bf16") if c.precision == "fp32" else None, "the same, here")
    result = _toy_plan(tmp_path, knobs, lambda config: 4, asked, twin=twin)
    assert result.rows and all(row.config.precision == "bf16" for row in result.rows)
    assert all(row.twin == row.config.replace(precision="fp32") for row in result.rows)
    assert result.twin_note == "the same, here" and result.to_dict()["rows"][0]["twin"].startswith("mb=")
    assert result.fitting == 2 * len(result.rows)  # each row stands for its config and its twin
    from rich.console import Console

    from autotune.output.render import print_plan

    console = Console(record=True, width=200)
    print_plan(result, Workload(global_batch=32), console=console)
    text = console.export_text()
    assert "mb=1 bf16/fp32" in text and "a/b: the same, here" in text


def test_a_plan_on_more_ranks_than_the_cards_node_spans_its_nodes_and_shards_within_them(tmp_path):
    """16 A100s fill two of their reference nodes (a DGX A100's 8): the plan prices the collectives between nodes at
    the card's network per GPU and plans hybrid sharding, whose shard groups are one node's ranks. Typed as one node
    (--gpus-per-node 16), hybrid has no node to shard within and is not planned."""
    from autotune.config.gpus import on_card_nodes

    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1]\n  precision: [bf16]\n  fsdp: [full, hybrid]\n")
    typed = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, nproc=16, gpu="A100-80GB")
    plans = {
        per_node: plan_space(
            workload=on_card_nodes(typed, per_node), space=str(tmp_path / "space.yaml"), memory_budget_bytes=2**30
        )
        for per_node in (None, 16)
    }
    assert {"full", "hybrid"} <= {row.config.fsdp for row in plans[None].rows}
    assert "on 2 nodes of 8 ranks, 18.8 GB/s a rank between them" in plans[None].profile_source
    assert "hybrid" not in {row.config.fsdp for row in plans[16].rows} and "nodes" not in plans[16].profile_source
    # The same FSDP full, its gathers over NVLink on one node, over the network on two: slower.
    full = {per_node: next(r for r in plan.rows if r.config.fsdp == "full") for per_node, plan in plans.items()}
    assert full[None].step.communication_s > full[16].step.communication_s


def _matmul_step(config, flops_per_sample: float):
    """An exact estimate of 1 MiB a sample whose step is one matmul (in the precision's type; checkpointing
    recomputes 30% of it) and one launch."""
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_costs import OpCost, StepCosts

    dtype = "bfloat16" if config.precision == "bf16" else "float32"
    rerun = 1.3 if config.checkpointing else 1.0
    matmul = OpCost("forward", "matmul", "mm", dtype, flops_per_sample * rerun, 0.0, 0.0, 1.0)
    return MemoryEstimate(
        config=config,
        predicted_peak_bytes=config.micro_batch * MiB,
        parameters_bytes=0,
        gradients_bytes=0,
        optimizer_state_bytes=0,
        activations_bytes=config.micro_batch * MiB,
        temporaries_bytes=0,
        overhead_bytes=None,
        method="test",
        seconds=0.0,
        step_costs=StepCosts((matmul, OpCost("forward", "other", "add", "float32", 0.0, 0.0, 0.0, 1.0)), 1.0),
    )


def test_a_slower_precision_whose_matmuls_alone_miss_the_top_row_by_the_models_error_is_not_traced(tmp_path):
    """bf16 multiplies 16x as fast as fp32 here. Its families are planned first, though the space lists fp32 first;
    an fp32 family does the same matmuls as its bf16 sibling, so their FLOPs at fp32's rate are a floor under its
    step. Where that floor is over the fastest row's step by more than the model's error, it is not traced; where the
    matmuls are a small part of the step (launches dominate), the floor rules out nothing and fp32 is traced."""
    from step_toys import TOY_CPU

    from autotune.estimate.step_time import predict_step_time

    profile = replace(TOY_CPU, matmul_flops={"float32": 1000.0, "bfloat16": 16000.0})
    workload = Workload(global_batch=32)
    (tmp_path / "space.yaml").write_text(
        "knobs:\n  micro_batch: [1, 2, 4]\n  precision: [fp32, bf16]\n  checkpointing: [false, true]\n"
    )

    def planned(flops_per_sample: float):
        asked: list = []

        def estimate(config, ahead=()):
            asked.append(config)
            return _matmul_step(config, flops_per_sample)

        return asked, _planned_on_a_toy_cpu(tmp_path / "space.yaml", estimate, profile=profile)

    # Matmul-bound: fp32's floor (32 x 100 / 1000 = 3.2 s) is 8x the fastest bf16 step's (0.2 + 8 x 0.05 s).
    asked, result = planned(100.0)
    assert [c.precision for c in asked] == ["bf16", "bf16"]  # each bf16 family once, fp32's never
    assert result.slower == 6 and result.slower_families == 2 and {r.config.precision for r in result.rows} == {"bf16"}
    assert result.to_dict()["slower_than_the_top"] == 6
    # What the floor stands for: each fp32 config's own predicted step is over the verify-first line.
    top = result.rows[0].step.step_s
    for config in (row.config.replace(precision="fp32") for row in result.rows):
        own = predict_step_time(_matmul_step(config, 100.0), workload, profile)
        assert own is not None and own.step_s * (1 - PLAN_ERROR) > top
    # Launch-bound: 32 x 1 / 1000 s of fp32 matmuls is far under the step's launches: fp32 is traced and ranked.
    asked, result = planned(1.0)
    assert sorted(c.precision for c in asked) == ["bf16", "bf16", "fp32", "fp32"] and result.slower == 0
    assert {r.config.precision for r in result.rows} == {"bf16", "fp32"}
