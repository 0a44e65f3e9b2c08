"""The ``parallel`` space: layouts of the ranks searched beside data parallel. Where a DDP copy of the model
does not fit, ``find`` answers a split layout, and its json export trains the user's model under torchrun."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from torchrun_jobs import run_job

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.output.exporters import export_config
from autotune.search.presets import load_space
from autotune.search.space import SearchSpace, layout_knobs
from autotune.search.tuner import find

# Four wide layers over a small vocabulary: the layers' weights (which TP and PP split) dominate.
_LAYERS = json.loads((Path(__file__).parents[2] / "bench" / "data" / "llama-layers.json").read_text())

_SPACE = """
description: data parallel against a tensor- and a pipeline-parallel split, fp32
n_trials: 6
knobs:
  micro_batch: [1]
  precision: [fp32]
  layout: [dp, tp2, pp2:1f1b]
"""

# The user's job: the same model built on every rank, prepared from the export, 3 optimizer steps.
_JOB = textwrap.dedent("""
    import json, math, sys
    import torch, torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    import autotune
    from autotune.prepare.optimizer import parameter_groups

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    export = json.load(open(sys.argv[2]))
    prepared = autotune.prepare(model, sys.argv[2])
    optimizer = torch.optim.AdamW(parameter_groups(list(prepared.parameters())), lr=1e-3)
    batch = torch.randint(0, 256, (export["workload"]["global_batch"], export["workload"]["seq_len"]))
    losses = []
    for _ in range(3):
        if export["config"]["pp"] > 1:  # the pipeline runs the step's whole batch through its stages
            loss = prepared.step(input_ids=batch, labels=batch)
        else:  # tensor-parallel ranks all see the batch; accumulation as in the trial
            accum = len(batch) // export["config"]["micro_batch"]
            for micro in batch.chunk(accum):
                loss = prepared(input_ids=micro, labels=micro).loss / accum
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    result = [type(prepared).__name__, len(losses), all(map(math.isfinite, losses))]
    open(f"result-{dist.get_rank()}.json", "w").write(json.dumps(result))  # one file per rank: no interleaving
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def layers_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(_LAYERS))
    return str(folder)


@pytest.mark.slow
def test_find_answers_a_split_layout_where_a_ddp_copy_does_not_fit_and_its_export_trains(
    layers_model, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text(_SPACE)
    workload = Workload(model=layers_model, seq_len=32, global_batch=4, nproc=2, device="cpu")
    # A DDP rank holds ~50 MiB here (weights, gradients, DDP's buckets, Adam), a tensor-parallel one ~22 MiB.
    summary = find(workload=workload, space="space.yaml", memory_budget_bytes=40 * 2**20, measure_steps=2)
    result = summary.to_dict()
    best = TrialConfig.from_dict(result["best"]["config"])
    assert best.model_parallel == 2, result["best"]
    assert result["best"]["peak_memory_bytes"] <= result["memory_limit_bytes"]
    layouts = {TrialConfig.from_dict(t["config"]).layout: t for t in result["trials"]}
    assert "dp" not in layouts or not layouts["dp"]["fits"], layouts.get("dp")  # measured OOM, or predicted over

    (tmp_path / "autotune.json").write_text(export_config(best, workload, fmt="json", device_type="cpu"))
    (tmp_path / "job.py").write_text(_JOB)
    results = run_job(tmp_path, layers_model, "autotune.json")
    kind = "Pipeline" if best.pp > 1 else "LlamaForCausalLM"
    # Every tensor-parallel rank computes the loss; only the pipeline's last stage does.
    steps = [0, 3] if best.pp > 1 else [3, 3]
    assert results == [[kind, n, True] for n in steps]


def test_the_parallel_preset_offers_every_split_the_model_takes_and_says_which_it_drops():
    space = load_space("parallel")
    workload = Workload(model="builtin:llama-tiny", nproc=2, global_batch=8, seq_len=32)
    device = detect_device("cpu")
    offered = space.choices(workload, device)["layout"]
    # llama-tiny's 2 layers cannot make 4 stages: interleaved 1F1B (two stages per rank) is left out, said once.
    assert offered == ("dp", "tp2", "tp2+sp", "pp2:gpipe", "pp2:1f1b")
    assert any("fewer than the 4 stages" in line for line in space.dropped_knobs(workload, device))
    configs = space.candidates(workload, device)
    for config in configs:  # the tuner's parameters of a config give the config back
        assert space.config_of(space.params_of(config)) == config
    assert not any(c.tp > 1 and c.uses_deepspeed for c in configs)  # refused combinations never proposed
    assert {c.layout for c in configs} == set(offered)
    # A model without a tensor-parallel plan keeps data parallel and the layouts it can take.
    gpt2 = Workload(model="builtin:gpt2-tiny", nproc=2, global_batch=8, seq_len=32)
    assert "tp2" not in space.choices(gpt2, device).get("layout", ("dp",))


def test_a_layout_label_gives_back_its_config_tensor_and_pipeline_splits_together():
    for config in (
        TrialConfig(),
        TrialConfig(tp=2, sequence_parallel=True),
        TrialConfig(pp=2, pp_schedule="gpipe"),
        TrialConfig(tp=2, pp=4, pp_schedule="interleaved-1f1b"),
    ):
        assert TrialConfig(**layout_knobs(config.layout)) == config, config.layout
    assert TrialConfig(tp=2, pp=2).describe() == "mb=1 fp32 tp2 pp2:1f1b"
    space = SearchSpace.from_dict({**load_space("parallel").to_dict(), "layout": ["dp", "tp2 pp2:1f1b"]})
    assert space.layout == ("dp", "tp2 pp2:1f1b")
    with pytest.raises(ConfigError, match=r"knobs.layout: 'tp2 tp4' is not allowed"):
        SearchSpace.from_dict({**load_space("parallel").to_dict(), "layout": ["tp2 tp4"]})


def test_spaces_without_the_layout_knob_keep_their_digest():
    # Studies made before the knob resume: a space at data parallel only hashes as it did.
    before = SearchSpace.from_dict({**load_space("default").to_dict()} | {"layout": ["dp"]})
    assert before.digest == load_space("default").digest
    assert "layout" not in load_space("default").choices(
        Workload(model="builtin:llama-tiny", nproc=2, global_batch=8, seq_len=32), detect_device("cpu")
    )
