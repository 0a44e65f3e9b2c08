"""The torchtitan export: each lever's values as torchtitan 0.2's TOML job config says them, read back by
torchtitan's own parser (``ConfigManager``, which refuses a key its JobConfig lacks) where torchtitan 0.2 is
installed (CI installs it: ``.ci/run``), and a one-line refusal for every value it has no key for."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import typing
from typing import Any

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.output.exporters import export_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: its forerunner
    tomllib = pytest.importorskip("tomli")

MODEL = "builtin:llama-tiny"
EIGHT_ON_TWO_NODES = Workload(model=MODEL, seq_len=64, global_batch=32, nproc=8, nodes=2)
FOUR = Workload(model=MODEL, seq_len=64, global_batch=32, nproc=4)

# (workload, config, the tables the export must hold: every key a test reads, by table)
CASES = {
    "hybrid over two nodes, selective per op, compiled, fused": (
        EIGHT_ON_TWO_NODES,
        TrialConfig(
            micro_batch=2,
            precision="bf16",
            checkpointing=True,
            checkpoint_selective=True,
            fsdp="hybrid",
            compile=True,
            fused_optimizer=True,
        ),
        {
            "training": {
                "local_batch_size": 2,
                "global_batch_size": 32,
                "seq_len": 64,
                "dtype": "float32",
                "mixed_precision_param": "bfloat16",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": {
                "data_parallel_replicate_degree": 2,
                "data_parallel_shard_degree": 4,
                "fsdp_reshard_after_forward": "always",
            },
            "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
            "compile": {"enable": True, "components": ["model"]},
            "optimizer": {"name": "AdamW", "implementation": "fused"},
        },
    ),
    "tp2 with sp under fsdp, bf16-true reduced in fp32, float8": (
        FOUR,
        TrialConfig(
            micro_batch=2,
            precision="bf16-true",
            tp=2,
            sequence_parallel=True,
            fsdp="full",
            reduce_dtype="fp32",
            float8=True,
        ),
        {
            "training": {"local_batch_size": 2, "global_batch_size": 32, "dtype": "bfloat16"},
            "parallelism": {
                "data_parallel_replicate_degree": 1,
                "data_parallel_shard_degree": 2,
                "tensor_parallel_degree": 2,
                "disable_loss_parallel": True,
            },
            "activation_checkpoint": {"mode": "none"},
            "model": {"converters": ["quantize.linear.float8"]},
            "quantize.linear.float8": {"recipe_name": "tensorwise", "filter_fqns": ["output"]},
        },
    ),
    "interleaved pipeline, every second layer checkpointed": (
        FOUR,
        TrialConfig(
            micro_batch=1,
            precision="bf16",
            pp=2,
            pp_schedule="interleaved-1f1b",
            checkpointing=True,
            checkpoint_every=2,
        ),
        {
            # 2 data-parallel ranks x 16 accumulation steps of 1: each rank's step is one local batch of 16,
            # which the pipeline splits into its 16 micro batches of 1.
            "training": {"local_batch_size": 16, "global_batch_size": 32},
            "parallelism": {
                "data_parallel_replicate_degree": 2,
                "data_parallel_shard_degree": 1,
                "pipeline_parallel_degree": 2,
                "pipeline_parallel_schedule": "Interleaved1F1B",
                "pipeline_parallel_microbatch_size": 1,
            },
            "activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"},
        },
    ),
    "ddp in fp32, every layer checkpointed, stepped in the backward": (
        FOUR,
        TrialConfig(micro_batch=4, checkpointing=True, optimizer_in_backward=True),
        {
            "training": {"local_batch_size": 4, "dtype": "float32", "mixed_precision_param": "float32"},
            "parallelism": {"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1},
            "activation_checkpoint": {"mode": "full"},
            "optimizer": {"name": "AdamW", "implementation": "foreach", "early_step_in_backward": True},
        },
    ),
    "fsdp grad-op offloaded to the CPU": (
        FOUR,
        TrialConfig(micro_batch=2, precision="bf16", fsdp="grad-op", offload="optimizer+params"),
        {
            "training": {"enable_cpu_offload": True},
            "parallelism": {"data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": "never"},
        },
    ),
}


def exported(workload: Workload, config: TrialConfig) -> str:
    return export_config(config, workload, fmt="torchtitan", device_type="cuda")


@pytest.mark.parametrize("case", CASES)
def test_each_levers_values_are_torchtitans_keys(case):
    workload, config, expected = CASES[case]
    text = exported(workload, config)
    tables = _tables(tomllib.loads(text))
    for table, keys in expected.items():
        for key, value in keys.items():
            assert tables[table][key] == value, (table, key)
    # The same global batch either way: local batch x accumulation x data-parallel ranks.
    training, parallelism = tables["training"], tables["parallelism"]
    ranks = parallelism["data_parallel_replicate_degree"] * parallelism["data_parallel_shard_degree"]
    assert training["global_batch_size"] % (training["local_batch_size"] * ranks) == 0
    assert text.startswith(f"# autotune export: {MODEL}, {config.describe()}\n")


@pytest.mark.parametrize("case", CASES)
def test_torchtitans_own_parser_reads_every_key_as_written(case, tmp_path):
    """torchtitan 0.2's ConfigManager loads the file (a key its JobConfig lacks is an error there); each key
    reads back as written, and each value is one its JobConfig's type allows."""
    manager = _torchtitan_config_manager()
    workload, config, _ = CASES[case]
    path = tmp_path / "torchtitan.toml"
    path.write_text(exported(workload, config))
    job = manager().parse_args(["--job.config_file", str(path)])
    for table, keys in _tables(tomllib.loads(path.read_text())).items():
        section = job
        for part in table.split("."):
            section = getattr(section, part)
        hints = typing.get_type_hints(type(section))
        for key, value in keys.items():
            assert getattr(section, key) == value, (table, key)
            allowed = _literal_values(hints[key])
            assert allowed is None or value in allowed, (table, key, value, allowed)


def test_torchtitans_parser_refuses_a_key_it_lacks(tmp_path):
    """What the test above leans on: a key torchtitan's JobConfig has not is an error, not ignored."""
    manager = _torchtitan_config_manager()
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nlocal_batch_size = 2\nmicro_batch = 2\n")
    with pytest.raises(ValueError, match="micro_batch"):
        manager().parse_args(["--job.config_file", str(path)])


REFUSED = {
    "deepspeed": (TrialConfig(micro_batch=2, zero_stage=3), "DeepSpeed's ZeRO stage 3"),
    "lora": (TrialConfig(micro_batch=2, lora_rank=8), "lora8"),
    "fp16": (TrialConfig(micro_batch=2, precision="fp16"), "fp16"),
    "tf32": (TrialConfig(micro_batch=2, precision="tf32"), "tf32"),
    "chunked loss": (TrialConfig(micro_batch=2, loss="chunked"), "chunked"),
    "tp without sp": (TrialConfig(micro_batch=2, tp=2), "without --sp"),
    "8-bit adam": (TrialConfig(micro_batch=2, optimizer="adamw-8bit"), "adamw-8bit"),
    "grad sync on the last step": (
        TrialConfig(micro_batch=2, fsdp="full", grad_sync="last"),
        "--grad-sync last",
    ),
    "bf16-true reduced in bf16": (TrialConfig(micro_batch=2, precision="bf16-true", fsdp="full"), "--reduce-dtype"),
    "eager attention": (TrialConfig(micro_batch=2, attention="eager"), "eager"),
    "activation offload": (TrialConfig(micro_batch=2, activation_offload=True), "torchtitan's job config has no key"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_value_torchtitan_has_no_key_for_is_refused_in_one_line(case):
    config, named = REFUSED[case]
    with pytest.raises(ConfigError) as refused:
        exported(FOUR, config)
    message = str(refused.value)
    assert message.startswith("--format torchtitan: ") and "\n" not in message
    assert named in message


def test_a_cpu_config_is_refused_for_torchtitan_which_trains_on_gpus():
    config = TrialConfig(micro_batch=2)
    with pytest.raises(ConfigError, match="--format torchtitan: torchtitan trains on GPUs"):
        export_config(config, FOUR, fmt="torchtitan", device_type="cpu")


def _tables(document: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """A TOML document's tables by dotted name (``quantize.linear.float8``), each with its own keys."""
    tables: dict[str, dict[str, Any]] = {}
    for name, value in document.items():
        if isinstance(value, dict):
            nested = {key: item for key, item in value.items() if not isinstance(item, dict)}
            if nested:
                tables[prefix + name] = nested
            tables.update(_tables({k: v for k, v in value.items() if isinstance(v, dict)}, f"{prefix}{name}."))
    return tables


def _literal_values(hint: Any) -> set[Any] | None:
    """The values a Literal annotation (or an optional one) allows; None: any of its type."""
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    literals = [arg for arg in typing.get_args(hint) if typing.get_origin(arg) is typing.Literal]
    return {value for literal in literals for value in typing.get_args(literal)} or None


def _torchtitan_config_manager() -> Any:
    """torchtitan 0.2's ConfigManager, or a skip where it is not installed (CI installs it and says so). Its
    package ``__init__`` imports the model code (Triton's kernels, which a CPU machine lacks): only its config
    modules are loaded, under a bare package of the same folder."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.submodule_search_locations is None:
        if os.environ.get("AUTOTUNE_TEST_TORCHTITAN"):
            pytest.fail("AUTOTUNE_TEST_TORCHTITAN is set but torchtitan is not installed (.ci/run installs it)")
        pytest.skip("torchtitan 0.2 is not installed: pip install --no-deps torchtitan==0.2.2 tyro")
    from importlib.metadata import version

    assert version("torchtitan").startswith("0.2."), f"torchtitan {version('torchtitan')}: these tests read 0.2's"
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["torchtitan"] = package
    from torchtitan.config.manager import ConfigManager

    return ConfigManager
