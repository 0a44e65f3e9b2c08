"""The command line as a user runs it: a real `python -m autotune` process each time."""

from __future__ import annotations

import json
import subprocess

import commands
import pytest

REQUIRED_KEYS = {"config", "status", "tokens_per_s", "samples_per_s", "peak_memory_bytes", "error"}


def autotune(*args: str) -> subprocess.CompletedProcess[str]:
    return commands.autotune(*args, timeout=300)


@pytest.mark.slow
def test_trial_json_is_one_object_with_the_documented_keys():
    proc = autotune(
        "trial",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
        "--checkpointing",
        "on",
        "--steps",
        "2",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert REQUIRED_KEYS <= result.keys()
    assert result["status"] == "ok" and result["error"] is None
    assert result["config"]["micro_batch"] == 2 and result["config"]["checkpointing"] is True
    assert result["tokens_per_s"] > 0 and result["peak_memory_bytes"] > 0


@pytest.mark.slow
def test_trial_table_and_non_ok_exit_status():
    proc = autotune(
        "trial",
        "--model",
        "builtin:gpt2-tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
        "--memory-budget",
        "4MiB",
        "--steps",
        "1",
    )
    assert proc.returncode == 1
    assert "status" in proc.stdout and "oom" in proc.stdout and "--memory-budget" in proc.stdout


def test_models_lists_the_presets():
    proc = autotune("models", "--json")
    presets = json.loads(proc.stdout)
    assert {"gpt2-tiny", "llama-tiny", "bert-tiny"} <= presets.keys()
    assert presets["bert-tiny"]["task"] == "seq-cls"


@pytest.mark.slow
def test_a_hub_id_is_read_from_the_local_cache(tmp_path):
    """The Hub cache layout as `hf download` leaves it: refs/main names a snapshot holding config.json."""
    import os

    repo = tmp_path / "models--tiny-org--tiny-gpt2"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_layer": 1,
                "n_embd": 32,
                "n_head": 2,
                "vocab_size": 128,
                "n_positions": 64,
            }
        )
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = commands.autotune(
        "trial",
        "--model",
        "tiny-org/tiny-gpt2",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--micro-batch",
        "2",
        "--steps",
        "1",
        "--json",
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["total_params"] < 100_000
