"""Every export is loaded by the library it is for: DeepSpeed, transformers, PEFT, Accelerate, Lightning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.config.deepspeed_config import deepspeed_config
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.output.exporters import (
    DEFAULT_FILENAMES,
    FORMATS,
    export_config,
    export_files,
)
from autotune.trial.rendezvous import one_node_ranks

WORKLOAD = Workload(model="builtin:gpt2-tiny", global_batch=16)
GPT2_TINY_WIDTH = 128
FULL_BF16 = TrialConfig(micro_batch=4, precision="bf16", checkpointing=True)
ZERO2_OFFLOAD = TrialConfig(micro_batch=2, zero_stage=2, offload="optimizer")
ZERO3_OFFLOAD_ALL = TrialConfig(micro_batch=8, zero_stage=3, offload="optimizer+params")
LORA = TrialConfig(micro_batch=4, lora_rank=8)
FUSED = TrialConfig(micro_batch=4, fused_optimizer=True)


def _write(
    tmp_path: Path, config: TrialConfig, fmt: str, *, workload: Workload = WORKLOAD, device_type: str = "cpu"
) -> Path:
    path = tmp_path / DEFAULT_FILENAMES[fmt]
    path.write_text(export_config(config, workload, fmt=fmt, device_type=device_type))
    return path


# -- dispatch ---------------------------------------------------------------------------------
def test_every_format_has_a_default_filename() -> None:
    assert set(DEFAULT_FILENAMES) == set(FORMATS)


def test_unknown_format_names_the_flag_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"--format toml is not known; use one of json, yaml, deepspeed"):
        export_config(FULL_BF16, WORKLOAD, fmt="toml")


# -- json / yaml ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["json", "yaml"])
@pytest.mark.parametrize(
    "config", [FULL_BF16, ZERO2_OFFLOAD, LORA.replace(lora_targets=("c_attn",))], ids=["bf16", "zero2", "lora"]
)
def test_json_and_yaml_round_trip(fmt: str, config: TrialConfig) -> None:
    summary = {"study": "demo", "tokens_per_s": 1234.5}
    text = export_config(config, WORKLOAD, fmt=fmt, summary=summary)
    loaded = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert TrialConfig.from_dict(loaded["config"]) == config
    assert Workload.from_dict(loaded["workload"]) == WORKLOAD
    assert loaded["grad_accum_steps"] == config.grad_accum_steps(WORKLOAD)
    assert loaded["trains"]["precision"] == config.precision
    assert (loaded["trains"]["lora"] is not None) == config.uses_lora
    assert loaded["study"] == "demo" and loaded["tokens_per_s"] == 1234.5


def test_summary_cannot_overwrite_the_config() -> None:
    with pytest.raises(ValueError, match="config"):
        export_config(FULL_BF16, WORKLOAD, fmt="json", summary={"config": {}})


@pytest.mark.parametrize("fmt", ["yaml", "accelerate", "lightning"])
def test_yaml_formats_say_what_is_trained_in_their_header(fmt: str) -> None:
    text = export_config(LORA, WORKLOAD, fmt=fmt, summary={"study": "demo"})
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert "# trains: LoRA r=8 adapters only, on c_attn (PEFT's default targets for gpt2), trained in fp32" in header
    assert any(line.startswith("# LoRA: rank 8, alpha 16") for line in header)
    assert any("micro batch: 4 per rank" in line for line in header)
    assert "# study: demo" in header
    full = export_config(FULL_BF16, WORKLOAD, fmt=fmt)
    assert "# trains: all weights trained in bf16 mixed precision" in full.splitlines()
    assert "# LoRA: off (all weights trained)" in full.splitlines()


# -- DeepSpeed --------------------------------------------------------------------------------
# deepspeed.initialize in a fresh process: it joins a process group and sets global state.
_DEEPSPEED_INIT = textwrap.dedent("""
    import json, sys
    import deepspeed, torch

    deepspeed.init_distributed(dist_backend="gloo")
    seen = []
    for path in sys.argv[1:]:
        model = torch.nn.Linear(8, 8)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path)
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        batch = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, dtype=dtype)
        engine.backward(engine(batch).float().square().mean())
        engine.step()
        seen.append({"micro": engine.train_micro_batch_size_per_gpu(),
                     "accum": engine.gradient_accumulation_steps(),
                     "stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
                     "offload_optimizer": engine.zero_offload_optimizer() is not None,
                     "offload_params": engine.zero_offload_param() is not None})
    print("RESULT " + json.dumps(seen))
""")


@pytest.mark.slow
def test_deepspeed_export_initialises_a_deepspeed_engine(tmp_path: Path) -> None:
    configs = [FULL_BF16, ZERO2_OFFLOAD, ZERO3_OFFLOAD_ALL]
    paths = []
    for i, config in enumerate(configs):
        (tmp_path / str(i)).mkdir()
        paths.append(str(_write(tmp_path / str(i), config, "deepspeed")))
    env = {**os.environ, **one_node_ranks(1)[0]}
    proc = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED_INIT, *paths], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    seen = json.loads(result.removeprefix("RESULT "))
    assert seen == [
        {
            "micro": c.micro_batch,
            "accum": c.grad_accum_steps(WORKLOAD),
            "stage": c.zero_stage or 0,
            "bf16": c.precision == "bf16",
            "offload_optimizer": c.offload != "none",
            "offload_params": c.offload == "optimizer+params",
        }
        for c in configs
    ]


def test_deepspeed_buckets_follow_the_model_width_when_its_config_is_readable() -> None:
    zero = json.loads(export_config(ZERO2_OFFLOAD, WORKLOAD, fmt="deepspeed"))["zero_optimization"]
    assert zero["reduce_bucket_size"] == GPT2_TINY_WIDTH**2
    factory = WORKLOAD.replace(model="factories:tiny")  # not imported: its width is unknown
    zero = json.loads(export_config(ZERO2_OFFLOAD, factory, fmt="deepspeed"))["zero_optimization"]
    assert "reduce_bucket_size" not in zero and zero["stage"] == 2


# -- Hugging Face TrainingArguments -----------------------------------------------------------
@pytest.mark.usefixtures("_fresh_accelerate_state")
@pytest.mark.filterwarnings("error:`gradient_checkpointing:FutureWarning")  # the deprecated name is not written
@pytest.mark.parametrize("config", [FULL_BF16, ZERO2_OFFLOAD, LORA, FUSED], ids=["bf16", "zero2", "lora", "fused"])
def test_hf_export_builds_training_arguments(tmp_path: Path, config: TrialConfig) -> None:
    from transformers import TrainingArguments

    kwargs = json.loads(export_config(config, WORKLOAD, fmt="hf", device_type="cpu"))
    args = TrainingArguments(output_dir=str(tmp_path), **kwargs)
    assert args.per_device_train_batch_size == config.micro_batch
    assert args.gradient_accumulation_steps == config.grad_accum_steps(WORKLOAD)
    assert args.activation_checkpointing is config.checkpointing
    assert "gradient_checkpointing" not in kwargs and "gradient_checkpointing_kwargs" not in kwargs
    assert args.bf16 is (config.precision == "bf16")
    assert args.use_cpu is True
    if not config.uses_deepspeed:  # the AdamW the trials ran, not Transformers' default (the fused one)
        assert args.optim == ("adamw_torch_fused" if config.fused_optimizer else "adamw_torch")
    if not config.uses_deepspeed:
        assert args.deepspeed is None
        return
    ds = args.hf_deepspeed_config.config  # the "auto" values, filled in by TrainingArguments
    assert ds["zero_optimization"]["stage"] == config.zero_stage
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == config.micro_batch
    assert ds["train_batch_size"] == WORKLOAD.global_batch
    assert ds["optimizer"]["params"]["lr"] == args.learning_rate
    assert args.deepspeed_plugin.zero_stage == config.zero_stage


# -- PEFT -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "workload", "targets", "task_type"),
    [
        (LORA, WORKLOAD, {"c_attn"}, "CAUSAL_LM"),  # PEFT's default for gpt2, named: what the trials adapted
        (LORA.replace(lora_alpha=4, lora_targets=("c_attn", "c_proj")), WORKLOAD, {"c_attn", "c_proj"}, "CAUSAL_LM"),
        (LORA.replace(lora_targets=("all-linear",)), Workload(model="builtin:bert-tiny"), "all-linear", "SEQ_CLS"),
    ],
    ids=["default-targets", "named-targets", "all-linear-seq-cls"],
)
def test_peft_export_loads_as_lora_config(
    tmp_path: Path, config: TrialConfig, workload: Workload, targets: Any, task_type: str
) -> None:
    from peft import LoraConfig

    _write(tmp_path, config, "peft", workload=workload)
    lora = LoraConfig.from_pretrained(str(tmp_path))
    assert (lora.r, lora.lora_alpha) == (config.lora_rank, config.effective_lora_alpha)
    assert lora.target_modules == targets
    assert lora.task_type == task_type


def test_peft_export_applies_to_the_workload_model(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from autotune.models.sources import build_model

    _write(tmp_path, LORA, "peft")
    model = get_peft_model(
        build_model(WORKLOAD, task="causal-lm", device=torch.device("cpu")), LoraConfig.from_pretrained(str(tmp_path))
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


def test_peft_export_refuses_a_config_without_lora() -> None:
    with pytest.raises(ConfigError, match=r"--format peft: .*no LoRA.*--space lora"):
        export_config(FULL_BF16, WORKLOAD, fmt="peft")


# -- Accelerate -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "workload", "device_type", "distributed", "precision"),
    [
        (FULL_BF16, WORKLOAD, "cpu", "NO", "bf16"),
        (FULL_BF16, WORKLOAD.replace(nproc=2), "cpu", "MULTI_CPU", "bf16"),
        (LORA.replace(micro_batch=2, precision="fp16"), WORKLOAD.replace(nproc=2), "cuda", "MULTI_GPU", "fp16"),
        (ZERO3_OFFLOAD_ALL.replace(micro_batch=4), WORKLOAD.replace(nproc=2), "cuda", "DEEPSPEED", None),
    ],
    ids=["single-cpu", "multi-cpu", "multi-gpu", "zero3"],
)
def test_accelerate_export_loads_as_accelerate_config(
    tmp_path: Path, config: TrialConfig, workload: Workload, device_type: str, distributed: str, precision: str | None
) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    files = export_files(
        config, workload, tmp_path / "accelerate_config.yaml", fmt="accelerate", device_type=device_type
    )
    for path, text in files:
        path.write_text(text)
    loaded = load_config_from_file(str(files[0][0]))
    assert loaded.distributed_type.value == distributed
    assert loaded.mixed_precision == precision
    assert loaded.num_processes == workload.nproc
    assert loaded.use_cpu is (device_type == "cpu")
    if not config.uses_deepspeed:
        assert loaded.deepspeed_config == {} and len(files) == 1
        return
    # The YAML names the DeepSpeed config written beside it; `accelerate launch` hands both to DeepSpeedPlugin.
    assert loaded.deepspeed_config == {
        "deepspeed_config_file": str(tmp_path / "accelerate_config.deepspeed.json"),
        "zero3_init_flag": True,
    }
    plugin = DeepSpeedPlugin(hf_ds_config=loaded.deepspeed_config["deepspeed_config_file"], zero3_init_flag=True)
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == config.zero_stage == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == config.grad_accum_steps(workload)
    assert plugin.zero3_init_flag is True
    # The trial's buckets (hidden size squared), not DeepSpeed's 5e8-element defaults.
    assert zero["reduce_bucket_size"] == GPT2_TINY_WIDTH**2
    assert zero["stage3_param_persistence_threshold"] == 10 * GPT2_TINY_WIDTH
    assert "optimizer" not in plugin.deepspeed_config  # the script's own optimizer (Accelerate refuses both)


@pytest.mark.slow
def test_the_accelerate_export_of_a_zero_config_trains_under_accelerate_launch_with_the_trials_buckets(tmp_path):
    config = TrialConfig(micro_batch=2, precision="bf16", zero_stage=2)
    for path, text in export_files(
        config, WORKLOAD, tmp_path / "accelerate_config.yaml", fmt="accelerate", device_type="cpu"
    ):
        path.write_text(text)
    job = Path(__file__).parents[1] / "scripts" / "accelerate_zero_job.py"
    ran = subprocess.run(
        # --log_dir: torchrun's logs here (Accelerate passes None for it, and torchrun makes a folder in /tmp)
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "accelerate_config.yaml",
            "--log_dir",
            str(tmp_path / "torchrun"),
            str(job),
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(
        next(line for line in ran.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT ")
    )
    del seen["peak_bytes"]  # bench/zero_buckets.py's figure
    # DeepSpeed's own buckets (5e8 elements) would be what accelerate launch builds from YAML keys alone.
    assert seen == {"stage": 2, "bf16": True, "reduce": GPT2_TINY_WIDTH**2, "allgather": GPT2_TINY_WIDTH**2}


# -- Lightning --------------------------------------------------------------------------------
def _lightning_kwargs(config: TrialConfig, *, device_type: str, workload: Workload = WORKLOAD) -> dict[str, Any]:
    text = export_config(config, workload, fmt="lightning", device_type=device_type)
    return yaml.safe_load(text)["trainer"]


def _trainer(tmp_path: Path, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        **kwargs, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False, enable_checkpointing=False
    )


def test_lightning_export_builds_a_trainer(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, **_lightning_kwargs(FULL_BF16, device_type="cpu"))
    assert trainer.accumulate_grad_batches == FULL_BF16.grad_accum_steps(WORKLOAD)
    assert trainer.precision == "bf16-mixed"
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"


def _strategy(spec: str | dict[str, Any]) -> Any:
    """A strategy as LightningCLI builds it: a registered name as is, a class_path from its init_args."""
    import importlib

    if isinstance(spec, str):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec["init_args"])


@pytest.mark.parametrize("config", [ZERO2_OFFLOAD, ZERO3_OFFLOAD_ALL], ids=["zero2", "zero3"])
def test_lightning_deepspeed_export_builds_a_trainer_with_the_trials_buckets(
    tmp_path: Path, config: TrialConfig
) -> None:
    kwargs = _lightning_kwargs(config, device_type="cuda")
    assert kwargs.pop("accelerator") == "gpu"
    strategy = _strategy(kwargs.pop("strategy"))
    trainer = _trainer(tmp_path, accelerator="cpu", strategy=strategy, **kwargs)  # only fit() needs CUDA
    assert trainer.accumulate_grad_batches == config.grad_accum_steps(WORKLOAD)
    assert trainer.precision == "32-true"
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["stage"] == config.zero_stage and zero["offload_optimizer"]["device"] == "cpu"
    # The trial's buckets (hidden size squared), not Lightning's 2e8-element defaults.
    trial = deepspeed_config(config, WORKLOAD, hidden_size=GPT2_TINY_WIDTH)["zero_optimization"]
    assert zero["reduce_bucket_size"] == trial["reduce_bucket_size"] == GPT2_TINY_WIDTH**2
    if config.zero_stage == 2:
        assert zero["allgather_bucket_size"] == trial["allgather_bucket_size"]


def test_lightning_deepspeed_on_a_cpu_is_refused() -> None:
    # Lightning builds such a Trainer but fit() raises "only supported on CUDA GPUs".
    with pytest.raises(ConfigError, match=r"--format lightning: .*--zero-stage 2 .*CUDA.*accelerate"):
        export_config(ZERO2_OFFLOAD, WORKLOAD, fmt="lightning", device_type="cpu")


@pytest.mark.parametrize(
    ("config", "strategy"),
    [
        (TrialConfig(micro_batch=2, zero_stage=1), "deepspeed_stage_1"),
        (ZERO3_OFFLOAD_ALL, "deepspeed_stage_3_offload"),
        (FULL_BF16, "ddp"),
    ],
)
def test_lightning_strategy_names_are_registered(config: TrialConfig, strategy: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    # A factory model: its width (so the trial's buckets) is unknown, and the registered name says it all.
    kwargs = _lightning_kwargs(config, device_type="cuda", workload=WORKLOAD.replace(model="factories:tiny", nproc=2))
    assert kwargs["strategy"] == strategy and kwargs["devices"] == 2
    assert strategy in StrategyRegistry


@pytest.mark.parametrize(
    "config",
    [
        TrialConfig(micro_batch=2, zero_stage=0),
        TrialConfig(micro_batch=2, zero_stage=3, offload="optimizer"),
    ],
    ids=["stage0", "zero3-optimizer-offload"],
)
def test_lightning_deepspeed_without_a_registered_name_uses_class_path(tmp_path: Path, config: TrialConfig) -> None:
    kwargs = _lightning_kwargs(config, device_type="cuda", workload=WORKLOAD.replace(model="factories:tiny"))
    strategy = _strategy(kwargs.pop("strategy"))
    trainer = _trainer(tmp_path, **{**kwargs, "accelerator": "cpu"}, strategy=strategy)
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["stage"] == config.zero_stage
    assert ("offload_optimizer" in zero) == (config.offload != "none")
    assert "offload_param" not in zero


def test_lightning_tf32_stays_32_true_and_says_how_to_enable_tf32() -> None:
    text = export_config(TrialConfig(micro_batch=4, precision="tf32"), WORKLOAD, fmt="lightning")
    assert yaml.safe_load(text)["trainer"]["precision"] == "32-true"
    assert 'torch.set_float32_matmul_precision("high")' in text


# -- FSDP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, reshard", [("full", True), ("grad-op", False)])
def test_fsdp_exports_load_in_their_libraries_with_the_trials_sharding(tmp_path, mode, reshard):
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers import TrainingArguments

    workload = Workload(model="builtin:llama-tiny", nproc=2, global_batch=8)
    config = TrialConfig(micro_batch=2, precision="bf16", fsdp=mode, offload="optimizer+params")
    kwargs = json.loads(export_config(config, workload, fmt="hf", device_type="cuda"))
    assert kwargs["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    args = TrainingArguments(output_dir=str(tmp_path), **{**kwargs, "use_cpu": True})
    plugin = args._process_fsdp_args()
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is reshard and plugin["cpu_offload"]
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"

    path = tmp_path / "accelerate.yaml"
    path.write_text(export_config(config, workload, fmt="accelerate", device_type="cuda"))
    cluster = ClusterConfig.from_yaml_file(path)
    assert cluster.distributed_type == "FSDP" and cluster.num_processes == 2
    assert cluster.fsdp_config["fsdp_version"] == 2 and cluster.fsdp_config["fsdp_reshard_after_forward"] is reshard
    assert cluster.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"

    text = export_config(config, workload, fmt="lightning", device_type="cuda")
    assert "# fsdp: one unit per LlamaDecoderLayer, then the root" in text
    strategy = yaml.safe_load(text)["trainer"]["strategy"]
    built = FSDPStrategy(**strategy["init_args"])
    assert built.sharding_strategy.name == ("FULL_SHARD" if reshard else "SHARD_GRAD_OP")
    assert built.cpu_offload.offload_params


def test_a_hybrid_export_loads_in_accelerate_and_lightning_with_the_trials_groups(tmp_path, monkeypatch):
    """--fsdp hybrid on 2 nodes x 8 GPUs (shard groups of one node): Accelerate's FSDP2 with its ParallelismConfig
    (dp_replicate 2 x dp_shard 8, handed to the script through accelerate launch's environment), Lightning's
    FSDPStrategy HYBRID_SHARD on a (2, 8) mesh; TrainingArguments (a JSON file) and DeepSpeed refuse in a line."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env
    from lightning.pytorch.strategies import FSDPStrategy

    workload = Workload(model="builtin:llama-tiny", nproc=16, nodes=2, global_batch=16)
    config = TrialConfig(micro_batch=1, precision="bf16", fsdp="hybrid")
    path = tmp_path / "accelerate.yaml"
    path.write_text(export_config(config, workload, fmt="accelerate", device_type="cuda"))
    loaded = load_config_from_file(str(path))
    assert loaded.fsdp_config["fsdp_version"] == 2 and loaded.fsdp_config["fsdp_reshard_after_forward"] is True
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    env = prepare_multi_gpu_env(args)
    for name, value in env.items():
        if name.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM")):
            monkeypatch.setenv(name, value)
    mesh = ParallelismConfig()  # what the script's Accelerator builds from accelerate launch's environment
    assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.tp_size) == (2, 8, 1)

    lightning = yaml.safe_load(export_config(config, workload, fmt="lightning", device_type="cuda"))
    strategy = lightning["trainer"]["strategy"]
    assert strategy["init_args"]["device_mesh"] == [2, 8]
    built = FSDPStrategy(**{**strategy["init_args"], "device_mesh": tuple(strategy["init_args"]["device_mesh"])})
    assert built.sharding_strategy.name == "HYBRID_SHARD" and built.kwargs["device_mesh"] == (2, 8)

    for fmt, why in (("hf", "an Accelerate ParallelismConfig object"), ("deepspeed", "which DeepSpeed does not run")):
        with pytest.raises(ConfigError, match=why) as refused:
            export_config(config, workload, fmt=fmt, device_type="cuda")
        assert "\n" not in str(refused.value)
    # the other FSDP modes are no DeepSpeed config either (before, a ZeRO-0 one: DDP)
    with pytest.raises(ConfigError, match="--fsdp full"):
        export_config(config.replace(fsdp="full"), workload, fmt="deepspeed", device_type="cuda")
    # --shard-group given: the groups it says
    grouped = config.replace(shard_group=4)
    text = export_config(grouped, workload, fmt="lightning", device_type="cuda")
    assert yaml.safe_load(text)["trainer"]["strategy"]["init_args"]["device_mesh"] == [4, 4]
    assert json.loads(export_config(grouped, workload, fmt="json"))["config"]["shard_group"] == 4


# -- several nodes ----------------------------------------------------------------------------
TWO_NODES = WORKLOAD.replace(nproc=4, nodes=2)  # 2 ranks on each node


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_the_record_of_a_two_node_config_says_its_nodes_and_a_one_node_one_says_nothing_new(fmt: str) -> None:
    load = json.loads if fmt == "json" else yaml.safe_load
    loaded = load(export_config(FULL_BF16, TWO_NODES, fmt=fmt))
    assert loaded["workload"]["nodes"] == 2 and Workload.from_dict(loaded["workload"]) == TWO_NODES
    assert "nodes" not in load(export_config(FULL_BF16, WORKLOAD, fmt=fmt))["workload"]  # as before --nodes
    if fmt == "yaml":
        assert "# nodes: 2, 2 ranks on each (4 in all); " in export_config(FULL_BF16, TWO_NODES, fmt=fmt)


@pytest.mark.parametrize(
    "config",
    [FULL_BF16, ZERO3_OFFLOAD_ALL.replace(micro_batch=2), TrialConfig(micro_batch=2, fsdp="full")],
    ids=["ddp", "zero3", "fsdp"],
)
def test_accelerate_launch_starts_a_two_node_export_as_the_trials_ranks_met(
    tmp_path: Path, config: TrialConfig, monkeypatch: pytest.MonkeyPatch
):
    """accelerate launch's own argument handling, up to the torchrun launch config it would run on each node."""
    import accelerate.utils.launch
    import torch.distributed.run as torchrun
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import _filter_args, prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    # The first node's launcher refuses a port in use on the machine it runs on: here that is this machine,
    # not gpu-a017, where a DeepSpeed trial of another test may hold 29500 (DeepSpeed's default) meanwhile.
    monkeypatch.setattr(accelerate.utils.launch, "is_port_in_use", lambda port: False)

    files = export_files(config, TWO_NODES, tmp_path / "accelerate_config.yaml", fmt="accelerate", device_type="cuda")
    for path, text in files:
        path.write_text(text)
    loaded = load_config_from_file(str(files[0][0]))
    assert (loaded.num_machines, loaded.num_processes, loaded.main_process_port) == (2, 4, 29500)
    # What the header says to run on every node (FIRST_NODE: the job's first host).
    header = files[0][1]
    assert "--rdzv_backend c10d --main_process_ip FIRST_NODE TRAIN_SCRIPT" in header
    argv = ["--config_file", str(files[0][0]), "--rdzv_backend", "c10d", "--main_process_ip", "gpu-a017", "train.py"]
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if config.uses_deepspeed:
        args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config)  # as launch_command sets it
        command, _ = prepare_deepspeed_cmd_env(args)
        assert command is None  # torchrun on each node, not DeepSpeed's pdsh launcher and its hostfile
    else:
        prepare_multi_gpu_env(args)
    parsed = _filter_args(args, torchrun.get_args_parser(), ["--training_script", "train.py"])
    parsed.log_dir = str(tmp_path / "torchrun")  # Accelerate's own log_dir (None) would make a folder in /tmp
    launch, _, _ = torchrun.config_from_args(parsed)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 2)  # num_processes: over all
    assert (launch.rdzv_backend, launch.rdzv_endpoint) == ("c10d", "gpu-a017:29500")


def test_a_one_node_accelerate_export_is_as_before() -> None:
    loaded = yaml.safe_load(export_config(FULL_BF16, WORKLOAD.replace(nproc=2), fmt="accelerate"))
    assert (loaded["num_machines"], loaded["num_processes"]) == (1, 2) and "main_process_port" not in loaded


def test_lightning_runs_a_two_node_export_on_each_nodes_devices(tmp_path: Path) -> None:
    kwargs = _lightning_kwargs(FULL_BF16, device_type="cpu", workload=TWO_NODES)
    assert (kwargs["num_nodes"], kwargs["devices"]) == (2, 2)
    trainer = _trainer(tmp_path, **kwargs)
    assert trainer.num_nodes == 2 and trainer.num_devices == 2 and trainer.world_size == 4
    assert "num_nodes" not in _lightning_kwargs(FULL_BF16, device_type="cpu")


# -- the launch script ------------------------------------------------------------------------
_RANK = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    said = f"RANK {dist.get_rank()} OF {dist.get_world_size()} SUM {int(total.item())} ARGS {sys.argv[1:]}"
    open(f"rank-{dist.get_rank()}.txt", "w").write(said)  # a file each: the ranks' stdout lines interleave
    # Without it a rank can exit while gloo's threads still run: "terminate called without an active
    # exception", SIGABRT (seen once in CI).
    dist.destroy_process_group()
""")
_ONE = 'import sys\nprint(f"ONE ARGS {sys.argv[1:]}")\n'


def _launch(tmp_path: Path, config: TrialConfig, workload: Workload, device_type: str = "cpu") -> Path:
    path = tmp_path / DEFAULT_FILENAMES["launch"]
    path.write_text(export_config(config, workload, fmt="launch", device_type=device_type))
    return path


def _bash(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], cwd=script.parent, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize("workload", [WORKLOAD, WORKLOAD.replace(nproc=2), TWO_NODES], ids=["1", "2", "2x2"])
@pytest.mark.parametrize("config", [FULL_BF16, ZERO2_OFFLOAD], ids=["ddp", "zero2"])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_launch_script_is_bash_that_sbatch_reads(tmp_path, workload, config, device_type) -> None:
    script = _launch(tmp_path, config, workload, device_type)
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    # sbatch reads #SBATCH lines up to the first command: all of them come before it.
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    options = [line for line in lines if line.startswith("#SBATCH")]
    assert all(lines.index(option) < first_command for option in options)
    assert f"#SBATCH --nodes={workload.nodes}" in options and "#SBATCH --ntasks-per-node=1" in options
    assert f"#SBATCH --cpus-per-task={workload.ranks_per_node}" in options  # a core for each rank of a node
    assert (f"#SBATCH --gpus-per-node={workload.ranks_per_node}" in options) == (device_type == "cuda")
    usage = _bash(script)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: ") and len(usage.stderr.splitlines()) == 1


def _local_env() -> dict[str, str]:
    """This Python's torchrun first on PATH, and no SLURM job around the script."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", "PYTHON": sys.executable}


@pytest.mark.slow
def test_a_one_node_launch_script_starts_the_trials_ranks(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_RANK)
    script = _launch(tmp_path, FULL_BF16, WORKLOAD.replace(nproc=2))
    assert script.read_text().splitlines()[-1] == 'exec torchrun --standalone --nproc-per-node=2 "$@"'
    ran = _bash(script, "train.py", "--lr", "1e-4", env=_local_env())
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)]
    assert said == [f"RANK {r} OF 2 SUM 1 ARGS ['--lr', '1e-4']" for r in (0, 1)]


def test_a_one_rank_launch_script_runs_python(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_ONE)
    ran = _bash(_launch(tmp_path, FULL_BF16, WORKLOAD), "train.py", "--x", env=_local_env())
    assert ran.returncode == 0 and ran.stdout == "ONE ARGS ['--x']\n", ran.stderr


# What SLURM sets in a batch job of two nodes (tests/trial/test_multinode.py's recorded allocation).
_TWO_NODE_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-a[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "4(x2)",
}


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol expands the job's host list")
@pytest.mark.parametrize(
    ("config", "cpus", "per_task"),
    [(FULL_BF16, "4(x2)", "4"), (ZERO2_OFFLOAD, "4(x2)", "4"), (FULL_BF16, "12,8", "8")],
    ids=["ddp", "zero2", "ddp-uneven-nodes"],
)
def test_a_two_node_launch_script_runs_the_trials_command_and_writes_deepspeeds_hostfile(
    tmp_path, config, cpus, per_task
) -> None:
    """In a recorded 2-node job, with SLURM's own scontrol: srun (here, one that records what it was asked to
    run: the job is not real) gets the command the multi-node trials ran, each node's torchrun with the job's
    CPUs there (the fewest where the nodes differ); a ZeRO config's hostfile lines are what DeepSpeed's
    launcher reads."""
    from deepspeed.launcher.runner import fetch_hostfile

    from autotune.trial.multinode import multinode_command

    script = _launch(tmp_path, config, TWO_NODES)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "srun.args"}\n')
    srun.chmod(0o755)
    job = {**_TWO_NODE_JOB, "SLURM_JOB_CPUS_PER_NODE": cpus}
    env = {**_local_env(), **job}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    ran = _bash(script, "train.py", "--lr", "1e-4", env=env)
    assert ran.returncode == 0, ran.stderr
    asked = (tmp_path / "srun.args").read_text().splitlines()
    assert f"--cpus-per-task={per_task}" in asked
    trial = multinode_command(job, nproc=4, argv=["train.py", "--lr", "1e-4"], python="python")
    python = trial.index("python")  # python -m torch.distributed.run: torchrun
    assert ["srun", *asked] == [*trial[:python], "torchrun", *trial[python + 3 :]]
    hostfile = tmp_path / "hostfile"
    if not config.uses_deepspeed:
        assert not hostfile.exists()
        return
    assert fetch_hostfile(str(hostfile)) == {"gpu-a017": 2, "gpu-a018": 2}


def test_a_two_node_launch_script_outside_a_two_node_job_says_so_and_starts_nothing(tmp_path: Path) -> None:
    script = _launch(tmp_path, ZERO2_OFFLOAD, TWO_NODES)
    for job in ({}, {**_TWO_NODE_JOB, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "vm"}):
        ran = _bash(script, "train.py", env={**_local_env(), **job})
        assert ran.returncode == 2 and len(ran.stderr.splitlines()) == 1, ran.stderr
        assert "this config trains over 2 nodes: run it in a SLURM job of 2 nodes" in ran.stderr
        assert not (tmp_path / "hostfile").exists()


# -- activation offload: a knob no library's config has ----------------------------------------
OFFLOAD = TrialConfig(micro_batch=4, precision="bf16", checkpointing=True, activation_offload=True)


@pytest.mark.parametrize("fmt", ["yaml", "lightning", "accelerate"])
def test_yaml_exports_say_how_to_offload_activations(fmt: str) -> None:
    header = [line for line in export_config(OFFLOAD, WORKLOAD, fmt=fmt).splitlines() if line.startswith("#")]
    offload = [line for line in header if line.startswith("# activation offload:")]
    assert len(offload) == 1 and "offload_activations()" in offload[0] and "compute_loss_context_manager" in offload[0]
    assert not any("activation offload" in line for line in export_config(FULL_BF16, WORKLOAD, fmt=fmt).splitlines())


@pytest.mark.usefixtures("_fresh_accelerate_state")
def test_the_hf_exports_trainer_offloads_its_forward_as_the_line_beside_it_says(tmp_path: Path) -> None:
    """The hf export's TrainingArguments have no key for it; the Trainer subclass the export's line describes
    runs each forward (not the backward) inside the offload hooks."""
    import torch
    from transformers import Trainer, TrainingArguments

    from autotune.levers.activation_offload import ActivationOffload
    from autotune.models.sources import build_model_and_batch
    from autotune.output.study_export import trains_line

    kwargs = json.loads(export_config(OFFLOAD, WORKLOAD, fmt="hf", device_type="cpu"))
    assert not any("offload" in key for key in kwargs)
    assert "subclass Trainer with compute_loss_context_manager" in trains_line(OFFLOAD, "hf", WORKLOAD)
    packed: list[torch.Size] = []

    class Counting(ActivationOffload):  # the CPU standing in for the GPU, counting what it would move
        def pack(self, tensor: torch.Tensor) -> object:
            packed.append(tensor.shape)
            return super().pack(tensor)

    class OffloadTrainer(Trainer):
        def compute_loss_context_manager(self):  # type: ignore[no-untyped-def]
            stack = super().compute_loss_context_manager()
            stack.enter_context(Counting(device_type="cpu", pin_memory=False).hooks())
            return stack

    model, _ = build_model_and_batch(WORKLOAD, task="causal-lm", device=torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="no", **kwargs)
    OffloadTrainer(model=model, args=args, train_dataset=data).train()
    assert packed  # the forward ran inside the hooks, and the step trained with what they gave back


def test_a_format_that_cannot_carry_a_levers_values_is_refused_in_one_line():
    # DeepSpeed's bf16 mode keeps fp32 master weights: bf16-true (every weight in bf16) is not its mode.
    with pytest.raises(ConfigError, match=r"--format deepspeed: this config trains in bf16-true.*--format hf") as no:
        export_config(TrialConfig(micro_batch=4, precision="bf16-true"), WORKLOAD, fmt="deepspeed", device_type="cuda")
    assert "\n" not in str(no.value)
    # The same config is written in the formats that carry it.
    hf = json.loads(export_config(TrialConfig(micro_batch=4, precision="bf16-true"), WORKLOAD, fmt="hf"))
    assert hf["bf16"] is True and hf["fp16"] is False
