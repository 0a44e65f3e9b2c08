"""Tensor, sequence and pipeline parallel trials on gloo ranks: each rank holds less than a DDP copy of a
model whose states dominate, pipeline schedules trade memory as they should (GPipe holds every micro
batch's activations, 1F1B at most one per stage), and the estimator predicts every rank within 5% (a pipeline
stage's within 1%)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.trial.runner import run_trial


@pytest.fixture(scope="module")
def layers_model():
    """Four wide layers over a small vocabulary: the layers' weights (which TP and PP split) dominate."""
    return str(Path(__file__).parents[2] / "bench" / "data" / "llama-layers.json")


@pytest.fixture(scope="module")
def untied_tp(layers_model):
    """The two-rank tensor parallel trial of ``layers_model``: two tests read it (--dist loadfile keeps a file on one
    worker), measured once."""
    return _trial(layers_model, 2, tp=2)


def _trial(model: str, nproc: int, *, seq_len: int = 32, **knobs):
    workload = Workload(model=model, seq_len=seq_len, global_batch=4, nproc=nproc, device="cpu")
    config = TrialConfig(**{"micro_batch": 1, **knobs})
    return workload, config, run_trial(workload, config, warmup_steps=1, measure_steps=2, timeout_s=300)


@pytest.mark.slow
def test_two_rank_layouts_hold_less_than_ddp_and_the_estimator_predicts_every_rank(layers_model, untied_tp):
    _, _, ddp = _trial(layers_model, 2, micro_batch=2)
    assert ddp.status.value == "ok", ddp.error
    trials = {
        "tp": untied_tp,
        "tp+sp": _trial(layers_model, 2, tp=2, sequence_parallel=True),
        "pp 1f1b": _trial(layers_model, 2, pp=2),
        "pp gpipe": _trial(layers_model, 2, pp=2, pp_schedule="gpipe"),
        "pp interleaved": _trial(layers_model, 2, pp=2, pp_schedule="interleaved-1f1b"),
    }
    for name, (_, _, result) in trials.items():
        assert result.status.value == "ok", (name, result.error)
        assert len(result.peak_memory_per_rank) == 2
        assert result.peak_memory_bytes < ddp.peak_memory_bytes, (name, result.peak_memory_bytes, ddp.peak_memory_bytes)
        assert result.grad_accum_steps == 4  # ranks that split one model share its micro batches
    for name, (workload, config, result) in trials.items():
        predicted = predict_memory(workload, config)
        assert predicted.predicted_peak_bytes == pytest.approx(result.peak_memory_bytes, rel=0.05), name
        if config.pp > 1:  # each stage's rank: the first holds the embedding, the last the head and the logits
            # Within 1%: the trace runs the same schedule, and keeps what its sends keep (interleaved 1F1B was 4-5%
            # under while the fake group's sends let go of their tensors); measured equal to 0.01 MiB.
            for rank, peak in enumerate(result.peak_memory_per_rank):
                assert predicted.peak_per_rank_bytes[rank] == pytest.approx(peak, rel=0.01), (name, rank)
    # The first stage holds the activations of every micro batch under GPipe, of at most two under 1F1B.
    first_1f1b, _ = trials["pp 1f1b"][2].peak_memory_per_rank
    first_gpipe, _ = trials["pp gpipe"][2].peak_memory_per_rank
    assert first_gpipe > first_1f1b


@pytest.mark.parametrize(
    ("knobs", "accumulation"),
    [({"tp": 2, "fsdp": "full"}, 2), ({"tp": 2, "pp": 2}, 4)],
    ids=["fsdp x tp", "pp x tp"],
)
@pytest.mark.slow
def test_two_dimensional_layouts_train_on_four_ranks_as_the_estimator_predicts(layers_model, knobs, accumulation):
    workload, config, result = _trial(layers_model, 4, **knobs)
    assert result.status.value == "ok", result.error
    assert len(result.peak_memory_per_rank) == 4
    assert result.grad_accum_steps == accumulation  # FSDP x TP: two data-parallel pairs; PP x TP: one
    predicted = predict_memory(workload, config)
    assert predicted.predicted_peak_bytes == pytest.approx(result.peak_memory_bytes, rel=0.05)
    if config.pp > 1:  # ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1
        stages = result.peak_memory_per_rank
        for rank, peak in enumerate(stages):
            assert predicted.peak_per_rank_bytes[rank // 2] == pytest.approx(peak, rel=0.05), rank


@pytest.mark.slow
def test_a_tied_embedding_stays_one_weight_on_each_tensor_parallel_rank(layers_model, untied_tp, tmp_path):
    # Each rank makes its weights from the meta device: the embedding and the head it is tied to must stay
    # one parameter there, as the estimator traces them (a copy each held 3 MiB more on a 1000-token Qwen2).
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**json.loads(Path(layers_model).read_text()), "tie_word_embeddings": True}))
    workload, config, result = _trial(str(tied), 2, tp=2)
    _, _, untied = untied_tp
    assert result.status.value == "ok", result.error
    assert result.total_params < untied.total_params  # the head is the embedding: counted once
    assert predict_memory(workload, config).predicted_peak_bytes == pytest.approx(result.peak_memory_bytes, rel=0.05)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.slow
def test_a_split_head_and_its_gathered_logits_are_predicted_to_the_byte(sequence_parallel):
    # A 32,000-word head split over 2 ranks: each holds half its weight and gathers the logits whole. The trace
    # once counted the gather's wait as a second copy of the logits (+8.2 MB here, 5% of the peak).
    workload, config, result = _trial(
        "builtin:llama-tiny-32k", 2, seq_len=64, micro_batch=2, tp=2, sequence_parallel=sequence_parallel, loss="plain"
    )
    assert result.status.value == "ok", result.error
    predicted = predict_memory(workload, config).predicted_peak_bytes
    assert predicted == pytest.approx(result.peak_memory_bytes, abs=1024), (predicted, result.peak_memory_bytes)
