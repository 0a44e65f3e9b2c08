"""Where `autotune export -o` writes: a directory gets the format's usual file name inside it, PEFT's
adapter config lands where `LoraConfig.from_pretrained(dir)` reads it, a path that cannot be written
is one line naming -o (exit 2), and no temporary file is ever left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Two studies whose confirmed answers are a LoRA config and a ZeRO-2 one, stored as the tuner stores them.
_SEED = """
from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.search.presets import load_space
from autotune.study.storage import create_study, open_storage
from autotune.study.records import CONFIRM_PREFIX
from autotune.search.tuner import question
from autotune.config.workload import Workload
device = detect_device("cpu")
meta = question(workload=Workload(model="builtin:gpt2-tiny"), space=load_space("lora"), device=device,
                memory_budget_bytes=2**30, headroom=0.1)
configs = (("done", TrialConfig(micro_batch=4, lora_rank=8)), ("zero", TrialConfig(micro_batch=4, zero_stage=2)))
for name, config in configs:
    study = create_study(open_storage(None), name, meta)
    trial = study.ask()
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("status", "ok")
    trial.set_user_attr("result", {"tokens_per_s": 1000.0, "samples_per_s": 7.8, "peak_memory_bytes": 2**20})
    study.tell(trial, 1000.0)
    study.set_user_attr(CONFIRM_PREFIX + str(trial.number), {"confirmed": True, "tokens_per_s": 990.0,
                        "samples_per_s": 7.7, "peak_memory_bytes": 2**20})
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("export-output")
    proc = subprocess.run([sys.executable, "-c", _SEED], cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return work


# Each export runs the CLI's entry point (autotune.cli.main, what `python -m autotune` calls) in this process:
# a new interpreter paid 5 s of imports (PEFT's, Transformers') an export, seven times over, for what -o
# writes, which the export code decides alike either way. `python -m autotune export -o` as a real process:
# tests/search/test_tuner.py (show, export and report), tests/prepare/test_quantize.py (peft, hf, bnb),
# tests/scripts/test_script_tune.py; one-line errors with exit 2 from a real process: tests/test_bad_input.py.
@pytest.fixture
def export(monkeypatch, capfd):
    from autotune.cli import main

    def export(work: Path, *args: str, study: str = "done") -> subprocess.CompletedProcess[str]:
        monkeypatch.chdir(work)
        capfd.readouterr()
        argv = ["export", "--study", study, *args]
        code = main(argv)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["autotune", *argv], code, out, err)

    return export


def test_an_accelerate_zero_export_is_the_yaml_and_the_deepspeed_config_it_names(work, export):
    import json

    import yaml

    printed = export(work, "--format", "accelerate", study="zero")
    assert printed.returncode == 2 and printed.stdout == ""
    assert printed.stderr.strip().splitlines() == [
        "autotune: error: --format accelerate: mb=4 fp32 zero2 is two files, the Accelerate YAML and the DeepSpeed "
        "config it names; add -o accelerate_config.yaml to write both"
    ]
    proc = export(work, "--format", "accelerate", "-o", "zero/accelerate.yaml", study="zero")
    assert proc.returncode == 0, proc.stderr
    companion = Path("zero") / "accelerate.deepspeed.json"
    assert f"wrote {Path('zero') / 'accelerate.yaml'}, {companion} " in proc.stderr
    named = yaml.safe_load((work / "zero" / "accelerate.yaml").read_text())["deepspeed_config"]
    assert named == {"deepspeed_config_file": str(companion), "zero3_init_flag": False}
    assert json.loads((work / companion).read_text())["zero_optimization"]["stage"] == 2
    assert _no_temp_files(work / "zero")


def _no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.rglob(".*") if p.name != ".gitignore"]


@pytest.mark.slow
def test_an_existing_directory_gets_the_formats_file_name_inside_it(work, export):
    (work / "configs").mkdir()
    proc = export(work, "--format", "deepspeed", "-o", "configs")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {Path('configs') / 'ds_config.json'} " in proc.stderr
    assert (work / "configs" / "ds_config.json").is_file() and _no_temp_files(work / "configs")


@pytest.mark.parametrize("output", ["adapter/", "lora-adapter"])
@pytest.mark.slow
def test_peft_writes_adapter_config_json_in_the_directory_peft_loads(work, output, export):
    from peft import LoraConfig

    proc = export(work, "--format", "peft", "-o", output)
    assert proc.returncode == 0, proc.stderr
    folder = work / output.rstrip("/")
    assert folder.is_dir() and (folder / "adapter_config.json").is_file() and _no_temp_files(folder)
    loaded = LoraConfig.from_pretrained(str(folder))  # what the README shows
    assert loaded.r == 8 and loaded.target_modules == {"c_attn"}


@pytest.mark.slow
def test_peft_to_a_json_name_writes_that_file(work, export):
    proc = export(work, "--format", "peft", "-o", "mine.json")
    assert proc.returncode == 0, proc.stderr
    assert (work / "mine.json").is_file()


@pytest.mark.parametrize(
    "setup, output, message",
    [
        ("taken", "taken/", "-o taken/: taken/autotune.json is a directory; name a file to write"),
        ("a-file", "a-file/x.json", "-o a-file/x.json: cannot write a-file/x.json: "),
    ],
    ids=["target-is-a-directory", "parent-is-a-file"],
)
@pytest.mark.slow
def test_a_place_that_cannot_be_written_is_one_line_exit_2(work, setup, output, message, export):
    if setup == "taken":
        (work / "taken" / "autotune.json").mkdir(parents=True)
    else:
        (work / "a-file").write_text("not a directory")
    proc = export(work, "--format", "json", "-o", output)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autotune: error: {message}"), proc.stderr
    assert _no_temp_files(work)
