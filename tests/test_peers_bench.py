"""`bench/peers.py`: Lightning's and Accelerate's batch-size finders, the real library code, meet
the CPU budget's OOM in their own process, recognise it and retry smaller."""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def run_peer(name: str, tmp_path: Path) -> dict:
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers.py"),
            "--peer",
            name,
            "--result",
            str(result),
            "--budget-bytes",
            str(48 * MiB),
            "--model",
            "builtin:gpt2-deep-tiny",
            "--seq-len",
            "32",
            "--global-batch",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_lightning_power_scaling_stops_at_the_budget_oom_and_keeps_the_last_size_that_ran(tmp_path):
    tuned = run_peer("lightning-power", tmp_path)
    sizes = [(a["micro_batch"], a["steps_done"] >= 3) for a in tuned["attempts"]]
    # Doubling from 2 until the budget's OOM (48 MiB: 2 and 4 run, 8 does not), then the last that ran.
    assert sizes == [(2, True), (4, True), (8, False)]
    assert tuned["picked_micro_batch"] == 4


@pytest.mark.slow
def test_accelerate_shrinks_from_the_global_batch_until_a_size_runs_its_accumulated_steps(tmp_path):
    tuned = run_peer("accelerate", tmp_path)
    first, last = tuned["attempts"][0], tuned["attempts"][-1]
    assert (first["micro_batch"], first["accumulation"]) == (16, 1)
    assert first["steps_done"] < 2  # out of memory
    assert last["micro_batch"] == tuned["picked_micro_batch"] < 16
    assert last["steps_done"] == 2 * last["accumulation"]  # two whole optimizer steps ran


def _peers_module():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STARTED_AT = 1_790_000_000.0  # epoch seconds when find's process started


def _study(trials: list[tuple[int, dict, str, float | None, int, float | None]]):
    """A study as autotune's SQLite reader gives it: (number, config, status, tokens/s, peak, seconds
    after STARTED_AT that it completed), with a 100 MiB budget and 10% headroom (limit 90 MiB)."""
    from autotune.study.sqlite_reader import StoredStudy, StoredTrial
    from autotune.study.storage import META_KEY

    def at(seconds):
        return None if seconds is None else datetime.datetime.fromtimestamp(STARTED_AT + seconds)  # naive local

    return StoredStudy(
        study_name="s",
        user_attrs={META_KEY: {"memory_budget_bytes": 100 * MiB, "headroom": 0.1}},
        trials=[
            StoredTrial(
                number=number,
                state="COMPLETE" if done is not None else "RUNNING",
                user_attrs={
                    "config": config,
                    "status": status,
                    "result": {"tokens_per_s": tokens, "peak_memory_bytes": peak},
                },
                datetime_start=at(0.0 if done is None else done - 1.0),
                datetime_complete=at(done),
            )
            for number, config, status, tokens, peak, done in trials
        ],
    )


MB2 = {"micro_batch": 2, "precision": "fp32", "checkpointing": False}
MB4_BF16 = {"micro_batch": 4, "precision": "bf16", "checkpointing": False}
MB8 = {"micro_batch": 8, "precision": "fp32", "checkpointing": False}
MB16_CKPT = {"micro_batch": 16, "precision": "fp32", "checkpointing": True}


@pytest.fixture
def timeline():
    peers = _peers_module()
    study = _study(
        [
            (0, MB8, "ok", 500.0, 95 * MiB, 12.5),  # the fastest, but over the 90 MiB limit: it does not fit
            (1, MB4_BF16, "ok", 120.0, 60 * MiB, 20.0),
            (2, MB2, "ok", 100.0, 50 * MiB, 31.0),
            (3, MB16_CKPT, "ok", 200.0, 70 * MiB, 44.0),  # find's pick
            (4, {**MB16_CKPT, "precision": "bf16"}, "oom", None, None, 50.0),
            (5, MB4_BF16, "running", None, None, None),
        ]
    )
    return peers, peers.timeline_of(study, STARTED_AT)


def test_find_timeline_counts_seconds_from_finds_start_to_each_trials_completion(timeline):
    _, trials = timeline
    assert [(t["number"], t["fits"], t["throughput"]) for t in trials] == [
        (0, False, 500.0),
        (1, True, 120.0),
        (2, True, 100.0),
        (3, True, 200.0),
        (4, False, None),
        (5, False, None),
    ]
    assert [t["complete_s"] for t in trials[:5]] == pytest.approx([12.5, 20.0, 31.0, 44.0, 50.0], abs=1e-3)
    assert trials[5]["complete_s"] is None


def test_find_held_an_answer_as_good_as_the_peers_pick_when_its_first_trial_that_good_and_fitting_completed(
    timeline,
):
    peers, trials = timeline
    from autotune.config.knobs import TrialConfig

    mb2 = TrialConfig.from_dict(MB2).to_dict()
    # find measured the peer's very config (trial 2, 100 tokens/s): the threshold, on find's own scale;
    # trial 1 (120, fits) completed before it, trial 0 (500) did not fit. The paired ratio is not used.
    held = peers.held_after(trials, peer_config=mb2, same_global_batch=True, find_pick=3, paired_ratio=5.0)
    assert (held["rule"], held["threshold"], held["trial"]) == ("same config: trial 2", 100.0, 1)
    assert held["held_s"] == pytest.approx(20.0, abs=1e-3)

    # The same micro batch at another global batch is not the same run: the interleaved rounds' ratio
    # times find's pick's first figure (200): 0.7 -> 140, first reached by trial 3 at 44 s.
    held = peers.held_after(trials, peer_config=mb2, same_global_batch=False, find_pick=3, paired_ratio=0.7)
    assert held["rule"].startswith("paired ratio") and held["threshold"] == pytest.approx(140.0)
    assert (held["trial"], held["held_s"]) == (3, pytest.approx(44.0, abs=1e-3))
    assert held["describe"] == "mb=16 fp32 ckpt"

    # A config find never measured, and a pick faster than anything find held that fits: no figure.
    mb3 = TrialConfig.from_dict({**MB2, "micro_batch": 3}).to_dict()
    held = peers.held_after(trials, peer_config=mb3, same_global_batch=True, find_pick=3, paired_ratio=1.05)
    assert held["threshold"] == pytest.approx(210.0) and held["held_s"] is None and held["trial"] is None
    row = {"held_after": {"quick": held, "bench/spaces/fp32_micro_ckpt.yaml": {**held, "rule": None}}}
    assert peers._held_cell(row) == "`quick`: -; `fp32_micro_ckpt`: - (no figure to compare)"

    # No ratio (a round's runs failed) and the config not measured by find: nothing to compare with.
    held = peers.held_after(trials, peer_config=mb3, same_global_batch=True, find_pick=3, paired_ratio=None)
    assert held["rule"] is None and held["held_s"] is None


def test_a_pick_is_measured_with_every_knob_it_holds(timeline):
    peers, _ = timeline
    from autotune.config.knobs import TrialConfig

    config = TrialConfig(micro_batch=8, checkpointing=True, checkpoint_every=2, loss="chunked", fused_optimizer=True)
    flags = peers.trial_flags(config.to_dict())
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {
        "--micro-batch": "8",
        "--precision": "fp32",
        "--checkpointing": "every-2",
        "--loss": "chunked",
        "--attention": "auto",
        "--fused-optimizer": "on",
        "--optimizer": config.optimizer,
    }
