"""Script mode on a real CUDA device: the budget caps the script's own allocator, under a launcher too.

Marked ``gpu``: skipped on machines without CUDA, run on the GPU machine (see README).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.scripts.runner import run_script_trial
from autotune.trial.result import TrialStatus

pytestmark = pytest.mark.gpu

_CUDA_LOOP = """
import json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

settings = json.load(open(os.environ["AUTOTUNE_CONFIG"]))
micro = settings["config"]["micro_batch"]
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
model = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=8, vocab_size=8000)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(int(sys.argv[1])):
    ids = torch.randint(0, 8000, (micro, 512), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step(); optimizer.zero_grad()
"""
WORKLOAD = Workload(seq_len=512, global_batch=16, device="cuda")


@pytest.mark.parametrize(
    "launcher", [[], ["-m", "torch.distributed.run", "--nproc-per-node", "1"]], ids=["python", "torchrun"]
)
def test_a_cuda_script_is_capped_by_the_budget_in_the_process_that_trains(tmp_path: Path, launcher: list[str]):
    script = tmp_path / "cuda_loop.py"
    script.write_text(_CUDA_LOOP)
    command = [sys.executable, *launcher, str(script), "20"]
    fits = run_script_trial(command, WORKLOAD, TrialConfig(micro_batch=16), measure_steps=2)
    assert fits.status is TrialStatus.OK, fits.error
    assert fits.device.startswith("cuda") and fits.peak_reserved_bytes >= fits.peak_allocated_bytes > 0
    # The cap is set when the rank first uses CUDA (a launcher never does): half the peak is a real OOM.
    capped = run_script_trial(
        command,
        WORKLOAD,
        TrialConfig(micro_batch=16),
        measure_steps=2,
        memory_budget_bytes=fits.peak_allocated_bytes // 2,
    )
    assert capped.status is TrialStatus.OOM, capped.error
    assert "OutOfMemoryError" in capped.error


_LIGHTNING_CUDA = """
import json, os, sys
import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

micro = json.load(open(os.environ["AUTOTUNE_CONFIG"]))["config"]["micro_batch"]


class LanguageModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                                  num_attention_heads=8, vocab_size=8000))

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


data = torch.utils.data.DataLoader(torch.randint(0, 8000, (4096, 512)), batch_size=micro)
trainer = pl.Trainer(max_steps=int(sys.argv[1]), accelerator="gpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LanguageModel(), data)
"""


def test_a_lightning_script_on_cuda_trains_a_zero_config_through_the_strategy_it_is_given(tmp_path: Path):
    script = tmp_path / "lightning_cuda.py"
    script.write_text(_LIGHTNING_CUDA)
    command = [sys.executable, str(script), "20"]
    result = run_script_trial(
        command, WORKLOAD, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2), measure_steps=2
    )
    assert result.status is TrialStatus.OK, result.error  # an engine was built: not "trained without DeepSpeed"
    assert result.device.startswith("cuda") and result.peak_reserved_bytes > 0
