"""QLoRA's quantized base: NF4 and int8 bases under LoRA, held by bitsandbytes'
layers as from_pretrained with a BitsAndBytesConfig holds them, trained for real on this CPU, predicted by the
estimator, refused where they cannot run, and exported in the forms users load."""

from __future__ import annotations

import json
from pathlib import Path

import commands
import pytest
import torch
from refusals import trial_refusal

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.models.sources import build_model
from autotune.prepare import prepare
from autotune.trial.runner import run_trial

bnb = pytest.importorskip("bitsandbytes")

# Linear layers hold most of its weights (hidden 256, MLP 1024, a 512-token vocabulary), and 16 tokens of one
# sample keep the activations small: the base's bytes set the peak, which is what quantizing it acts on.
WIDE_LLAMA = Path(__file__).resolve().parents[2] / "bench" / "data" / "llama-wide.json"
QUANTIZED = [
    TrialConfig(lora_rank=16, quantize_base="nf4"),
    TrialConfig(lora_rank=16, quantize_base="int8"),
    TrialConfig(lora_rank=16, quantize_base="nf4", precision="bf16-true"),
]


@pytest.fixture(scope="module")
def wide() -> Workload:
    return Workload(model=str(WIDE_LLAMA), seq_len=16, global_batch=1)


@pytest.fixture(scope="module")
def plain(wide):
    """LoRA on the unquantized base, in each precision the quantized configs train in."""
    results = {}
    for precision in ("fp32", "bf16-true"):
        result = run_trial(wide, TrialConfig(lora_rank=16, precision=precision), warmup_steps=1, measure_steps=1)
        assert result.ok, result.error
        results[precision] = result
    return results


@pytest.mark.parametrize("config", QUANTIZED, ids=[c.describe() for c in QUANTIZED])
def test_a_quantized_base_trains_here_below_the_plain_peak_and_as_predicted(wide, plain, config):
    measured = run_trial(wide, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    unquantized = plain[config.precision]
    assert measured.peak_memory_bytes < unquantized.peak_memory_bytes * 0.85, (
        measured.peak_memory_bytes,
        unquantized.peak_memory_bytes,
    )
    # Built a layer at a time, each quantized as it is made: the build never holds the whole base unquantized.
    assert measured.build_peak_bytes < unquantized.build_peak_bytes, (measured.build_peak_bytes,)
    predicted = predict_memory(wide, config)
    error = predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1
    assert abs(error) <= 0.05, (predicted.to_dict(), measured.peak_memory_bytes)
    # The same model: NF4's packed bytes still count as the weights they hold.
    assert measured.total_params == unquantized.total_params
    assert measured.trainable_params == unquantized.trainable_params
    layer = "Linear4bit nf4" if config.quantize_base == "nf4" else "Linear8bitLt"
    assert measured.quantized_base.startswith(f"bitsandbytes {bnb.__version__} {layer}"), measured.quantized_base


def test_prepare_quantizes_every_linear_layer_but_the_head_and_leaves_a_quantized_model_as_it_is(wide):
    model = build_model(wide, task="causal-lm", device=torch.device("cpu"))
    config = TrialConfig(lora_rank=4, quantize_base="nf4", precision="bf16")
    adapted = prepare(model, config, workload=wide)
    layers = {name: type(module).__name__ for name, module in adapted.named_modules()}
    projections = [name for name in layers if name.endswith(("_proj.base_layer", "mlp.gate_proj", "mlp.down_proj"))]
    assert projections and all(layers[name] == "Linear4bit" for name in projections), layers
    assert layers["base_model.model.lm_head"] == "Linear"  # the head stays in full precision, as Transformers keeps it
    again = adapted.get_base_model()
    from autotune.prepare.model_facts import head_names
    from autotune.prepare.quantize import quantize_base

    assert quantize_base(again, config, heads=tuple(head_names(again, task="causal-lm"))) == 0
    batch = {"input_ids": torch.randint(0, 512, (1, 16)), "labels": torch.randint(0, 512, (1, 16))}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = adapted(**batch).loss
    loss.backward()
    trained = [p for p in adapted.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)


def _refusal(*args: str, without: tuple[str, ...] = ()) -> str:
    return trial_refusal(*args, model="builtin:llama-tiny", without=without)


@pytest.mark.parametrize(("mode", "double_quant"), [("nf4", False), ("nf4-dq", True)])
def test_as_lightning_quantizes_the_head_too_from_float16_with_the_modes_scales(wide, mode, double_quant):
    from autotune.prepare.quantize import as_lightning_quantizes

    model = build_model(wide, task="causal-lm", device=torch.device("cpu"))
    with as_lightning_quantizes(mode):
        adapted = prepare(model, TrialConfig(lora_rank=4, quantize_base="nf4", precision="bf16-true"), workload=wide)
    base = adapted.get_base_model()
    for layer in (base.lm_head, base.model.layers[0].mlp.down_proj):
        assert isinstance(layer, bnb.nn.Linear4bit), type(layer)
        state = layer.weight.quant_state
        assert (state.state2 is not None) == double_quant  # nf4: an fp32 scale per 64 weights; nf4-dq: 8-bit ones
        assert state.dtype == torch.float16  # Lightning casts each weight to float16 before quantizing it
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    # Outside the context, Transformers' way again: the head unquantized.
    again = prepare(
        build_model(wide, task="causal-lm", device=torch.device("cpu")),
        TrialConfig(lora_rank=4, quantize_base="nf4"),
        workload=wide,
    )
    assert type(again.get_base_model().lm_head) is torch.nn.Linear


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2():
    assert "add --lora-rank R" in _refusal("--quantize-base", "nf4")
    assert "is not known; use one of off, nf4, int8" in _refusal("--lora-rank", "4", "--quantize-base", "nf2")
    assert "drop the sharding" in _refusal("--lora-rank", "4", "--quantize-base", "nf4", "--zero-stage", "2")


@pytest.mark.slow
def test_a_quantized_base_without_bitsandbytes_names_the_package_to_install():
    refusal = _refusal("--lora-rank", "4", "--quantize-base", "int8", without=("bitsandbytes",))
    assert "pip install 'bitsandbytes>=0.48'" in refusal


LEAN_QUANTIZED = """\
description: LoRA on each base, quantized or not
n_trials: 6
knobs:
  micro_batch: [1]
  precision: [fp32, bf16-true]
  lora_rank: [16]
  quantize_base: [off, nf4, int8]
"""


@pytest.mark.slow
@pytest.mark.usefixtures("_fresh_accelerate_state")
def test_find_answers_with_a_quantized_base_where_none_other_fits_and_its_exports_train(wide, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, Trainer, TrainingArguments

    # 4 MiB less 10% headroom: LoRA on the bf16 base needs 4.6 MiB and on the fp32 one 9.6; the NF4 base
    # (2.5 MiB in bf16-true) and the int8 one (3.5) fit.
    (tmp_path / "lean.yaml").write_text(LEAN_QUANTIZED)
    args = ["--model", wide.model, "--seq-len", "16", "--global-batch", "1", "--memory-budget", "4MiB"]
    proc = commands.autotune("find", *args, "--space", "lean.yaml", "--json", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    best = TrialConfig.from_dict(answer["best"]["config"])
    assert best.quantize_base != "off", best.describe()
    statuses = {t["config"]["quantize_base"]: t["status"] for t in answer["trials"]}
    assert statuses.get("off") in (None, "oom", "skipped"), statuses  # never an answer: it does not fit
    files = {"hf": "hf.json", "peft": "adapter", "bnb": "bnb.json"}
    for fmt, out in files.items():
        export = commands.autotune(
            "export", "--study", answer["study"], "--format", fmt, "-o", out, cwd=tmp_path, timeout=300
        )
        assert export.returncode == 0, export.stderr
    # A user's job: the base loaded quantized by the bnb export's BitsAndBytesConfig (here: built, then quantized by
    # the function trials use, as no checkpoint can be downloaded), and the adapters of the peft export.
    quantization = BitsAndBytesConfig(**json.loads((tmp_path / "bnb.json").read_text()))
    if best.quantize_base == "nf4":
        assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
        assert quantization.bnb_4bit_use_double_quant
        assert quantization.bnb_4bit_compute_dtype == getattr(torch, best.sixteen_bit or "float32")
    else:
        assert quantization.load_in_8bit
    lora = LoraConfig.from_pretrained(str(tmp_path / "adapter"))
    assert lora.r == best.lora_rank
    model = build_model(wide, task="causal-lm", device=torch.device("cpu"))
    if best.true_16_bit:
        model = model.to(torch.bfloat16)
    from autotune.prepare.model_facts import head_names
    from autotune.prepare.quantize import quantize_base

    assert quantize_base(model, best, heads=tuple(head_names(model, task="causal-lm"))) > 0
    model = get_peft_model(model, lora)
    sample = {"input_ids": torch.randint(0, 512, (16,)), "labels": torch.randint(0, 512, (16,))}
    kwargs = json.loads((tmp_path / "hf.json").read_text())
    training = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], **kwargs)
    trainer = Trainer(model=model, args=training, train_dataset=[sample])
    assert trainer.train().global_step == 1


def test_the_cuda_prediction_holds_nf4_and_leaves_int8_to_a_trial(wide):
    from autotune.estimate.results import EstimateError

    on_a100 = wide.replace(gpu="A100-80GB")
    plain = predict_memory(on_a100, TrialConfig(lora_rank=16, precision="bf16-true"))
    nf4 = predict_memory(on_a100, TrialConfig(lora_rank=16, precision="bf16-true", quantize_base="nf4"))
    assert nf4.parameters_bytes < plain.parameters_bytes / 2, (nf4.parameters_bytes, plain.parameters_bytes)
    with pytest.raises(EstimateError, match="int8"):
        predict_memory(on_a100, TrialConfig(lora_rank=16, quantize_base="int8"))
