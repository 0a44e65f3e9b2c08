"""Tensor, sequence and pipeline parallel in a user's job: ``autotune.prepare`` under torchrun splits the
user's own model, and the split model computes the whole model's loss and gradients (the knobs are exact
up to rounding). Bad layouts are refused in one line before anything runs."""

from __future__ import annotations

import json
import textwrap

import pytest
from torchrun_jobs import run_job

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.output.exporters import export_config
from autotune.prepare import refusal_before_trial

# A user's script: their own model and batch; the reference is the same model whole, on every rank.
_JOB = textwrap.dedent("""
    import copy, json
    import torch, torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    import autotune
    from autotune.config.workload import Workload

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         tie_word_embeddings=False, attn_implementation="sdpa"))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    whole = copy.deepcopy(model)
    reference = whole(input_ids=ids, labels=ids).loss
    reference.backward()
    first, last = whole.model.layers[0].mlp.down_proj.weight.grad, whole.lm_head.weight.grad
    found = {"reference": reference.item()}

    for name, knobs in (("tp", {"tp": 2}), ("tp+sp", {"tp": 2, "sequence_parallel": True})):
        split = autotune.prepare(copy.deepcopy(model), **knobs)
        loss = split(input_ids=ids, labels=ids).loss
        loss.backward()
        weight, head = split.model.layers[0].mlp.down_proj.weight, split.lm_head.weight
        found[name] = {
            "kind": type(weight).__name__,
            "local": list(weight.to_local().shape),
            "head local": list(head.to_local().shape),
            "loss": loss.item(),
            "grad": (weight.grad.full_tensor() - first).abs().max().item(),
            "head grad": (head.grad.full_tensor() - last).abs().max().item(),
        }

    workload = Workload(model="builtin:llama-tiny", seq_len=16, global_batch=4, nproc=2)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        pipeline = autotune.prepare(copy.deepcopy(model), workload=workload, micro_batch=1, pp=2,
                                    pp_schedule=schedule)
        loss = pipeline.step(input_ids=ids, labels=ids)
        layers = [len(stage.layers) for stage in pipeline.stages]
        ends = {"loss": None if loss is None else loss.item(), "layers": layers}
        if pipeline.first:  # stage 0: the first layer's gradient
            ends["grad"] = (pipeline.stages[0].layers[0].mlp.down_proj.weight.grad - first).abs().max().item()
        if pipeline.last:  # the last stage: the head's
            ends["head grad"] = (pipeline.stages[-1].lm_head.weight.grad - last).abs().max().item()
        found[schedule] = ends
    open(f"result-{rank}.json", "w").write(json.dumps(found))  # one file per rank: no interleaved output
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_split_models_compute_the_whole_models_loss_and_gradients_under_torchrun(tmp_path):
    (tmp_path / "job.py").write_text(_JOB)
    ranks = dict(enumerate(run_job(tmp_path)))
    reference = ranks[0]["reference"]
    for rank, found in ranks.items():
        assert found["reference"] == pytest.approx(reference, rel=1e-6)  # the same model on every rank
        for name in ("tp", "tp+sp"):
            assert found[name]["kind"] == "DTensor"
            assert found[name]["local"] == [64, 64]  # down_proj's 128 inputs split over 2 ranks
            assert found[name]["head local"] == [128, 64]  # the head's 256 vocabulary rows split over 2 ranks
            assert found[name]["loss"] == pytest.approx(reference, rel=1e-5), (rank, name)
            assert found[name]["grad"] < 1e-5, (rank, name)
            assert found[name]["head grad"] < 1e-5, (rank, name)
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
            # Two stages of two layers each, or (interleaved) four stages of one, two on each rank.
            assert found[schedule]["layers"] == ([1, 1] if schedule == "interleaved-1f1b" else [2])
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert ranks[0][schedule]["loss"] is None  # the first stage computes no loss
        assert ranks[1][schedule]["loss"] == pytest.approx(reference, rel=1e-5), schedule
        assert ranks[0][schedule]["grad"] < 1e-5, schedule  # the batch's mean gradient, over 4 micro batches
        assert ranks[1][schedule]["head grad"] < 1e-5, schedule


def test_layouts_that_do_not_fit_the_ranks_or_the_model_are_refused_before_any_trial():
    cpu = detect_device("cpu")
    with pytest.raises(ConfigError, match=r"--tp 3 does not divide --nproc 2"):
        TrialConfig(tp=3).validate_for(Workload(model="builtin:llama-tiny", nproc=2), cpu)
    with pytest.raises(ConfigError, match=r"leaves 2 data-parallel copies, which DDP cannot hold .* --fsdp full"):
        TrialConfig(tp=2, micro_batch=2).validate_for(Workload(model="builtin:llama-tiny", nproc=4), cpu)
    # 2 accumulation steps for 4 stages: 1F1B needs a micro batch per stage.
    with pytest.raises(ConfigError, match=r"1F1B needs at least one per stage; use a micro batch of at most 1"):
        TrialConfig(pp=4, micro_batch=2).validate_for(
            Workload(model="builtin:llama-tiny", nproc=4, global_batch=4), cpu
        )
    refusal = refusal_before_trial(Workload(model="builtin:llama-tiny", nproc=4), TrialConfig(pp=4, micro_batch=4))
    assert refusal is not None and "has 2 decoder layers, fewer than the 4 stages" in refusal


def test_static_refusals_name_the_flag():
    with pytest.raises(ConfigError, match=r"--tp 2 with --zero-stage 3"):
        TrialConfig(tp=2, zero_stage=3)
    with pytest.raises(ConfigError, match=r"--sequence-parallel on .* add --tp 2"):
        TrialConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"--pp-schedule gpipe .* add --pp 2"):
        TrialConfig(pp_schedule="gpipe")
    with pytest.raises(ConfigError, match=r"--pp 2: --precision fp16"):
        TrialConfig(pp=2, precision="fp16")
    with pytest.raises(ConfigError, match=r"--tp 2 with LoRA"):
        TrialConfig(tp=2, lora_rank=8)


def test_a_model_whose_heads_do_not_split_or_whose_head_is_tied_is_refused(tmp_path):
    config = tmp_path / "three-heads.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 96,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 3,
                "num_key_value_heads": 3,
                "vocab_size": 256,
            }
        )
    )
    refusal = refusal_before_trial(Workload(model=str(config), nproc=2), TrialConfig(tp=2))
    assert refusal is not None and "3 attention heads, which 2 ranks cannot split evenly" in refusal
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": True}))
    refusal = refusal_before_trial(Workload(model=str(tied), nproc=2), TrialConfig(pp=2))
    assert refusal is not None and "ties its LM head to its embedding" in refusal
    gpt2 = refusal_before_trial(Workload(model="builtin:gpt2-tiny", nproc=2), TrialConfig(tp=2))
    assert gpt2 is not None and "has no tensor-parallel plan" in gpt2


# A user's LightningModule: its configure_model applies the json export over the strategy's mesh.
_LIGHTNING_JOB = textwrap.dedent("""
    import importlib, json, sys
    import yaml, torch
    import lightning.pytorch as L
    from transformers import LlamaConfig, LlamaForCausalLM
    import autotune
    from autotune.prepare.optimizer import parameter_groups

    trainer_args = yaml.safe_load(open(sys.argv[1]))["trainer"]
    spec = trainer_args.pop("strategy")  # built from its class_path, as LightningCLI builds it
    module, _, name = spec["class_path"].rpartition(".")
    strategy = getattr(importlib.import_module(module), name)(**spec["init_args"])

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        def configure_model(self):
            self.model = autotune.prepare(self.model, sys.argv[2], mesh=self.device_mesh)
        def training_step(self, batch, _):
            return self.model(input_ids=batch, labels=batch).loss
        def configure_optimizers(self):
            return torch.optim.AdamW(parameter_groups(list(self.parameters())), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.randint(0, 256, (16, 32)), batch_size=2)
    trainer = L.Trainer(**trainer_args, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), data)
    weight = trainer.lightning_module.model.model.layers[0].mlp.down_proj.weight
    found = [type(strategy).__name__, type(weight).__name__, trainer.global_step]
    open(f"result-{trainer.global_rank}.json", "w").write(json.dumps(found))  # one file per rank
""")


@pytest.mark.slow
def test_the_lightning_export_of_a_tensor_parallel_config_trains_under_model_parallel_strategy(tmp_path):
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2)
    config = TrialConfig(micro_batch=2, tp=2)
    (tmp_path / "trainer.yaml").write_text(export_config(config, workload, fmt="lightning", device_type="cpu"))
    (tmp_path / "autotune.json").write_text(export_config(config, workload, fmt="json", device_type="cpu"))
    (tmp_path / "job.py").write_text(_LIGHTNING_JOB)
    results = run_job(tmp_path, "trainer.yaml", "autotune.json")
    assert results == [["ModelParallelStrategy", "DTensor", 3]] * 2


@pytest.mark.parametrize("fmt", ["hf", "accelerate", "deepspeed"])
def test_formats_that_cannot_carry_the_layout_refuse_it_rather_than_drop_it(fmt):
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2)
    with pytest.raises(ConfigError, match=rf"--format {fmt}: this config splits layers with --tp 2"):
        export_config(TrialConfig(micro_batch=2, tp=2), workload, fmt=fmt, device_type="cpu")
    with pytest.raises(ConfigError, match=rf"--format {fmt}: this config runs --pp 2 pipeline stages"):
        export_config(TrialConfig(micro_batch=1, pp=2), workload, fmt=fmt, device_type="cpu")
    with pytest.raises(ConfigError, match=r"--format lightning: this config runs --pp 2"):
        export_config(TrialConfig(micro_batch=1, pp=2), workload, fmt="lightning", device_type="cpu")
