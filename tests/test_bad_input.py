"""Bad input, every command: one line on stderr that names the flag and the fix, exit status 2,
nothing on stdout, and the storage byte-for-byte as it was (a study already in it included)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import commands
import optuna
import pytest

BAD_SPACE = "knobs:\n  micro_batch: [1, 2]\n  precision: [fp8]\n"
UNKNOWN_KNOB = "knobs:\n  micro_batch: [1]\n  learning_rate: [0.1]\n"
NOT_A_MAPPING = "- just\n- a list\n"

BAD_INPUTS = [
    # flags and values
    (["trial", "--no-such-flag"], "No such option: --no-such-flag"),
    (["trial", "--micro-batch", "three"], "--micro-batch"),
    (
        ["trial", "--checkpointing", "maybe"],
        "--checkpointing 'maybe' must be on, off, every-N (e.g. every-2) or selective",
    ),
    (["trial", "--float8", "maybe"], "--float8 'maybe' must be on or off"),
    (
        ["estimate", "--model", "builtin:gpt2-tiny", "--gpu", "A100-80GB", "--float8", "on"],
        "--float8 on needs float8 tensor cores (compute capability 8.9 or newer",
    ),
    (["trial", "--checkpointing", "every-1"], "--checkpointing 'every-1': write every-N with N a whole number of 2"),
    (
        ["trial", "--model", "factories:tiny", "--checkpointing", "every-2"],
        "--checkpointing every-N: the model from --model factories:tiny is a factory's",
    ),
    (["trial", "--zero-stage", "two"], "--zero-stage 'two' is not known"),
    (["trial", "--offload", "optimizer"], "--offload optimizer needs ZeRO"),
    (["trial", "--lora-alpha", "16"], "--lora-alpha is set but LoRA is off"),
    (
        ["trial", "--model", "factories:tiny", "--seq-len", "64", "--lora-rank", "8"],
        "has no linear layer besides its task head to adapt; name the modules with --lora-targets",
    ),
    # layouts of the ranks
    (["trial", "--nproc", "2", "--tp", "3"], "--tp 3 does not divide --nproc 2"),
    (["trial", "--nproc", "2", "--tp", "2", "--model", "three_heads.json"], "3 attention heads, which 2 ranks cannot"),
    (
        ["trial", "--nproc", "4", "--pp", "4", "--micro-batch", "4", "--model", "builtin:llama-tiny"],
        "has 2 decoder layers, fewer than the 4 stages",
    ),
    (["trial", "--nproc", "2", "--tp", "2", "--zero-stage", "3"], "--tp 2 with --zero-stage 3: DeepSpeed partitions"),
    (["estimate", "--nproc", "2", "--tp", "2", "--model", "builtin:gpt2-tiny"], "has no tensor-parallel plan"),
    (["trial", "--fsdp", "banana"], "--fsdp 'banana' is not known; use off, full, grad-op or hybrid"),
    (["trial", "--fsdp", "full", "--zero-stage", "3", "--nproc", "2"], "--fsdp full with --zero-stage 3: one sharding"),
    (["tune", "--study", "kept", "--fsdp", "full"], "No such option: --fsdp"),
    (["trial", "--fsdp", "full"], "--fsdp full on one rank shards nothing; add --nproc 2 or more"),
    (["estimate", "--fsdp", "grad-op", "--offload", "optimizer", "--nproc", "2"], "--offload optimizer with --fsdp"),
    (["trial", "--fsdp", "hybrid", "--nproc", "4"], "--fsdp hybrid on one node shards over all --nproc 4 ranks"),
    (["trial", "--fsdp", "hybrid", "--shard-group", "3", "--nproc", "4"], "--shard-group 3 must divide --nproc 4"),
    (["trial", "--fsdp", "full", "--shard-group", "2", "--nproc", "4"], "add --fsdp hybrid, or drop --shard-group"),
    (["trial", "--fused-optimizer", "maybe"], "--fused-optimizer 'maybe' must be on or off"),
    (
        ["trial", "--fused-optimizer", "on", "--zero-stage", "2", "--nproc", "2"],
        "--fused-optimizer on with --zero-stage: DeepSpeed picks its own Adam kernel",
    ),
    (
        ["trial", "--loss", "chunky"],
        "--loss 'chunky' is not known; use standard, chunked, chunked-kept, plain, or chunked:K / chunked-kept:K",
    ),
    (["trial", "--loss", "chunked:1"], "--loss 'chunked:1' is not known"),
    (["trial", "--model", "builtin:bert-tiny", "--loss", "chunked"], "--loss chunked is a causal LM's loss"),
    (["estimate", "--model", "builtin:bert-tiny", "--loss", "chunked"], "--loss chunked is a causal LM's loss"),
    (["trial", "--trial-timeout", "0"], "--trial-timeout 0 must be more than 0"),
    (["find", "--max-time", "soon"], "--max-time 'soon' is not a duration; write a number with a unit, e.g. 90s"),
    (["find", "--executor", "slurm", "--max-time", "5m"], "--max-time 5m bounds a find on this machine"),
    (
        ["tune", "--study", "s", "--executor", "slurm", "--max-time", "5m"],
        "--max-time 5m bounds a tune on this machine",
    ),
    (["tune", "--study", "s", "--max-time", "0m"], "--max-time '0m' must be longer than zero"),
    (["tune", "--study", "kept", "--n-trials", "0"], "--n-trials 0 must be a number of at least 1"),
    (["tune", "--study", "kept", "--headroom", "2"], "--headroom 2.0 must be a fraction"),
    (["tune", "--study", "kept", "--workers", "0"], "--workers 0 must be a number of at least 1"),
    (["export", "--study", "kept", "--format", "onnx"], "--format 'onnx' is not known"),
    (["find", "-o", "x.json"], "-o/--output is the file for --export; add --export FORMAT"),
    # precisions and devices
    (["trial", "--precision", "fp8"], "--precision 'fp8' is not known"),
    (["trial", "--precision", "tf32", "--device", "cpu"], "--precision tf32 only exists on CUDA"),
    (["trial", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["trial", "--device", "cpu", "--activation-offload", "on"], "--activation-offload on moves saved activations"),
    (["estimate", "--device", "cpu", "--activation-offload", "on"], "on a cpu device they are in host memory already"),
    (["trial", "--activation-offload", "maybe"], "--activation-offload 'maybe' must be on or off"),
    # batches
    (
        ["trial", "--micro-batch", "3", "--global-batch", "32"],
        "--micro-batch 3 x --nproc 1 does not divide --global-batch 32",
    ),
    (["trial", "--nproc", "3"], "--global-batch 16 does not split over --nproc 3"),
    (["tune", "--study", "kept", "--global-batch", "10", "--nproc", "4"], "--global-batch 10 does not split"),
    (["trial", "--seq-len", "4096"], "--seq-len 4096 is longer than the model's 1024 positions"),
    # tasks
    (
        ["trial", "--task", "seq2seq-lm"],
        "--task seq2seq-lm: model type 'gpt2' (--model builtin:gpt2-tiny) has no decoder",
    ),
    (["trial", "--model", "builtin:t5-tiny", "--task", "causal-lm"], "is an encoder-decoder; use --task seq2seq-lm"),
    (["estimate", "--target-len", "0", "--model", "builtin:t5-tiny"], "--target-len 0 must be a whole number"),
    (["trial", "--target-len", "16"], "--target-len is the decoder's length of a seq2seq-lm task"),
    (["trial", "--model", "builtin:t5-tiny", "--loss", "chunked"], "--loss chunked is a causal LM's loss"),
    (
        ["trial", "--task", "image-cls"],
        "--task image-cls: model type 'gpt2' (--model builtin:gpt2-tiny) takes token ids",
    ),
    (["trial", "--model", "builtin:vit-tiny", "--task", "seq-cls"], "takes images; use --task image-cls"),
    (
        ["estimate", "--model", "builtin:vit-tiny", "--image-size", "0"],
        "--image-size 0 must be a whole number of pixels",
    ),
    (["trial", "--image-size", "64"], "--image-size is the input of an image-cls task"),
    (
        ["estimate", "--model", "builtin:resnet-tiny", "--checkpointing", "on"],
        "--checkpointing on: ResNetForImageClassification (--model builtin:resnet-tiny) does not support gradient",
    ),
    # budgets
    (["trial", "--memory-budget", "lots"], "--memory-budget 'lots' is not a size"),
    (["tune", "--study", "kept", "--memory-budget", "0"], "--memory-budget"),
    (["estimate", "--memory-budget", "-1GiB"], "--memory-budget"),
    (["estimate", "--precision", "tf32"], "--precision tf32 only exists on CUDA"),
    (["estimate", "--gpu", "banana"], "--gpu 'banana' is not a known card; use one of V100-16GB, V100-32GB, A100-40GB"),
    (["estimate", "--gpu", "H200-141GB"], "--gpu 'H200-141GB' is not a known card (did you mean H200?)"),
    (["estimate", "--gpu", "a100"], "--gpu 'a100' is not a known card (did you mean A100-40GB?)"),
    (
        ["estimate", "--gpu", "H100-80GB", "--device", "cpu"],
        "--gpu H100-80GB names a card for a CUDA workload, not --device cpu",
    ),
    (
        ["estimate", "--gpu", "A100-40GB", "--memory-budget", "80GiB"],
        "--memory-budget 80.0 GiB is more than A100-40GB's 40.0 GiB",
    ),
    (["estimate", "--gpu", "V100-16GB", "--precision", "bf16"], "--precision bf16: V100-16GB has no bfloat16"),
    (
        ["estimate", "--gpu", "H100-80GB", "--nproc", "12", "--global-batch", "12"],
        "--nproc 12 does not fill nodes of 8 GPUs (the H100-80GB's node; --gpus-per-node sets it)",
    ),
    (["estimate", "--gpus-per-node", "8"], "--gpus-per-node sizes the nodes of a card planned for; add --gpu CARD"),
    (
        [
            "find",
            "--plan",
            "--gpu",
            "A100-80GB",
            "--nproc",
            "16",
            "--global-batch",
            "16",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
        ],
        "--nodes 4 of --gpus-per-node 8 hold 32 GPUs, not --nproc 16",
    ),
    # a plan predicts from autotune's own trace, for a card: without one named and none here, or of a script: refused
    (["find", "--plan"], "--plan plans for a GPU and none is visible here: name the card with --gpu NAME"),
    (
        ["find", "--plan", "--gpu", "H100-80GB", "--", sys.executable, "train.py"],
        "--plan predicts from autotune's own trace of the model, and a training command cannot be traced",
    ),
    (["find", "--gpu", "H100-80GB"], "--gpu H100-80GB names a card to plan for, and find without --plan runs trials"),
    (["find", "--plan", "--gpu", "H100-80GB", "--export", "hf"], "--export writes a measured config; a plan has"),
    (
        ["find", "--plan", "--gpu", "A100-40GB", "--memory-budget", "80GiB"],
        "--memory-budget 80.0 GiB is more than A100-40GB's",
    ),
    # model sources
    (["trial", "--model", "builtin:gpt5"], "no such built-in model"),
    (["trial", "--model", "nobody/nothing"], "not in the local Hugging Face cache"),
    (["estimate", "--model", "no_such_module_xyz:build"], "--model no_such_module_xyz:build: no module"),
    # a typo in a factory's module: refused before a study, a trial or the estimate server starts
    (
        ["tune", "--study", "kept", "--model", "no_such_module_xyz:build"],
        "no module 'no_such_module_xyz' in the current directory, on PYTHONPATH or installed",
    ),
    (["trial", "--model", "no_such_module_xyz:build"], "--model no_such_module_xyz:build: no module"),
    (["tune", "--study", "kept", "--model", "empty_dir/"], "--model empty_dir/"),
    # search-space YAML
    (["tune", "--study", "kept", "--space", "nope"], "--space nope: no such preset"),
    (["tune", "--study", "kept", "--space", "bad.yaml"], "bad.yaml"),
    (["estimate", "--space", "unknown.yaml"], "learning_rate"),
    (["tune", "--study", "kept", "--space", "list.yaml"], "list.yaml"),
    # storage URLs and studies
    (["tune", "--study", "kept", "--storage", "not a url"], "--storage 'not a url' is not a database URL"),
    (["tune", "--study", "kept", "--storage", "sqlite://"], "in-memory SQLite database would be lost"),
    (["tune", "--study", "kept", "--storage", "oracle://u@h/db"], "--storage oracle://u@h/db"),
    (["show", "--study", "nope"], "--study nope: no such study"),
    (["tune", "--study", "kept", "--global-batch", "32"], "answers another question"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A working directory whose default storage already holds a study, with a trial in it."""
    work = tmp_path_factory.mktemp("bad-input")
    (work / "bad.yaml").write_text(BAD_SPACE)
    (work / "unknown.yaml").write_text(UNKNOWN_KNOB)
    (work / "list.yaml").write_text(NOT_A_MAPPING)
    (work / "empty_dir").mkdir()
    (work / "three_heads.json").write_text(THREE_HEADS)
    proc = subprocess.run([sys.executable, "-c", _SEED], cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return work


# A Llama whose 3 attention heads 2 tensor-parallel ranks cannot split.
THREE_HEADS = (
    '{"model_type": "llama", "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2, '
    '"num_attention_heads": 3, "num_key_value_heads": 3, "vocab_size": 256}'
)

# The study `kept` as `tune --study kept` (all defaults) would create it, with one finished trial.
_SEED = """
from autotune.config.device import detect_device
from autotune.search.presets import load_space
from autotune.study.storage import create_study, open_storage
from autotune.search.tuner import question
from autotune.config.workload import Workload
device = detect_device("auto")
meta = question(workload=Workload(), space=load_space("default"), device=device,
                memory_budget_bytes=device.total_memory_bytes, headroom=0.1)
study = create_study(open_storage(None), "kept", meta)
trial = study.ask()
trial.set_user_attr("status", "ok")
study.tell(trial, 123.0)
"""


def _dump(work: Path) -> list[str]:
    with sqlite3.connect(work / "storage" / "autotune.db") as db:
        return list(db.iterdump())


def test_at_least_twenty_bad_inputs():
    assert len(BAD_INPUTS) >= 20 and len({tuple(args) for args, _ in BAD_INPUTS}) == len(BAD_INPUTS)


def _check(work: Path, before: list[str], code: int, stdout: str, stderr: str, message: str) -> None:
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune"), stderr
    assert message in lines[0], lines[0]
    assert stdout == ""
    assert _dump(work) == before
    assert optuna.get_all_study_names(storage=f"sqlite:///{work}/storage/autotune.db") == ["kept"]


# Each row runs the CLI's entry point in this process (a new interpreter's imports cost seconds a row);
# the rows below run as real processes too, one per command, whose first imports may print as well.
@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_leaves_the_storage_as_it_was(work, args, message, monkeypatch, capfd):
    from autotune.cli import main

    before = _dump(work)
    monkeypatch.chdir(work)
    capfd.readouterr()
    code = main(list(args))
    stdout, stderr = capfd.readouterr()
    _check(work, before, code, stdout, stderr, message)


def _first_row_of_each_command() -> list[tuple[list[str], str]]:
    rows: dict[str, tuple[list[str], str]] = {}
    for args, message in BAD_INPUTS:
        rows.setdefault(args[0], (args, message))
    return list(rows.values())


@pytest.mark.parametrize(
    "args, message", _first_row_of_each_command(), ids=[" ".join(a) for a, _ in _first_row_of_each_command()]
)
def test_bad_input_to_a_real_autotune_process_is_one_line_exit_2(work, args, message):
    before = _dump(work)
    proc = commands.autotune(*args, cwd=work, timeout=300)
    _check(work, before, proc.returncode, proc.stdout, proc.stderr, message)
