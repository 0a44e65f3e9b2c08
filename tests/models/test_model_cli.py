"""Model sources and LoRA through the real command line: what `--model` names is what is measured."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import commands
import pytest

MINE = {
    "model_type": "gpt2",
    "n_layer": 3,
    "n_embd": 48,
    "n_head": 2,
    "n_positions": 256,
    "vocab_size": 300,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
DECOY = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 256, "vocab_size": 100}


def autotune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return commands.autotune(*args, cwd=cwd, timeout=300)


def _gpt2_params(config: dict) -> int:
    width, layers, vocab, positions = config["n_embd"], config["n_layer"], config["vocab_size"], config["n_positions"]
    block = 12 * width * width + 13 * width  # attention and MLP weights and biases, two layer norms
    return (vocab + positions) * width + layers * block + 2 * width  # lm_head tied to the embedding


@pytest.mark.slow
def test_trial_and_estimate_build_the_named_file_not_the_config_json_beside_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DECOY))
    (tmp_path / "my-model.json").write_text(json.dumps(MINE))
    proc = autotune(
        "trial",
        "--model",
        "my-model.json",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--micro-batch",
        "2",
        "--warmup-steps",
        "0",
        "--steps",
        "1",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_params"] == _gpt2_params(MINE) != _gpt2_params(DECOY)
    proc = autotune(
        "estimate",
        "--model",
        "my-model.json",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--micro-batch",
        "2",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parameters_bytes"] == 4 * _gpt2_params(MINE)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["trial", "estimate"])
def test_a_model_file_that_is_not_json_is_one_line_exit_2(tmp_path, command):
    (tmp_path / "model.yaml").write_text("hidden: 64\nlayers: 2\n")
    proc = autotune(command, "--model", "model.yaml", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --model model.yaml is not JSON"), proc.stderr
    assert proc.stdout == ""
