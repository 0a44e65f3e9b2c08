"""The same model measured through a Transformers Trainer script and through autotune's own synthetic
trial: the two rankings of the same configs side by side, and what a script trial costs on top.

    python bench/script_mode.py [--rounds 2] [--out bench/results/script_mode_cpu.json]

The script is tests/scripts/trainer_script.py (a 2-layer GPT-2, 128 wide, 1000-token vocabulary, 64
tokens a sample; it never imports autotune); the synthetic trial builds the same GPT-2 from a config
file. Eight configs (micro batch 1, 2, 4, 8 x fp32, bf16) at a global batch of 8, each measured both
ways in every round, interleaved (config by config, script then synthetic), so both see the same
machine. Per config: the median tokens/s over the rounds and the peak; per mode: the ranking, and the
wall seconds a trial costs beyond its timed steps (start-up, imports, model build, data, warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.scripts.runner import run_script_trial
from autotune.trial.runner import run_trial

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "scripts" / "trainer_script.py"), "40"]
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000, "n_positions": 64}
CONFIGS = [TrialConfig(micro_batch=mb, precision=p) for p in ("fp32", "bf16") for mb in (1, 2, 4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/script_mode_cpu.json"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    runs: dict[str, dict[str, list[dict]]] = {c.describe(): {"script": [], "synthetic": []} for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the Trainer script writes its output_dir where it runs
        (Path(tmp) / "config.json").write_text(json.dumps(GPT2))
        workload = Workload(
            model=str(Path(tmp) / "config.json"), task="causal-lm", seq_len=64, global_batch=8, device="cpu"
        )
        for round_ in range(args.rounds):
            for config in CONFIGS:
                for mode in ("script", "synthetic"):
                    started = time.perf_counter()
                    if mode == "script":
                        result = run_script_trial(SCRIPT, workload, config, measure_steps=3)
                    else:
                        result = run_trial(workload, config, measure_steps=3)
                    wall = time.perf_counter() - started
                    measured = result.phases.measure_s or 0.0
                    runs[config.describe()][mode].append(
                        {
                            "status": result.status.value,
                            "tokens_per_s": result.tokens_per_s,
                            "peak_memory_bytes": result.peak_memory_bytes,
                            "wall_s": wall,
                            "beyond_timed_steps_s": wall - measured,
                            "error": result.error,
                        }
                    )
                    print(
                        f"round {round_ + 1} {config.describe():<10} {mode:<9} {result.status.value:<5} "
                        f"{result.tokens_per_s or 0:9.1f} tokens/s  "
                        f"peak {(result.peak_memory_bytes or 0) / 2**20:6.1f} "
                        f"MiB  wall {wall:5.1f} s",
                        flush=True,
                    )
    rows, rankings = [], {}
    for mode in ("script", "synthetic"):
        figures = {
            name: statistics.median(r["tokens_per_s"] for r in by_mode[mode] if r["tokens_per_s"])
            for name, by_mode in runs.items()
            if all(r["status"] == "ok" for r in by_mode[mode])
        }
        rankings[mode] = sorted(figures, key=lambda name: -figures[name])
    for name, by_mode in runs.items():
        rows.append(
            {
                "config": name,
                **{
                    mode: {
                        "median_tokens_per_s": statistics.median(r["tokens_per_s"] or 0 for r in by_mode[mode]),
                        "peak_memory_bytes": max(r["peak_memory_bytes"] or 0 for r in by_mode[mode]),
                        "rank": rankings[mode].index(name) + 1 if name in rankings[mode] else None,
                        "runs": by_mode[mode],
                    }
                    for mode in ("script", "synthetic")
                },
            }
        )
    overhead = {
        mode: statistics.median(r["beyond_timed_steps_s"] for by_mode in runs.values() for r in by_mode[mode])
        for mode in ("script", "synthetic")
    }
    spearman = _spearman(rankings["script"], rankings["synthetic"])
    print(f"\n{'config':<10} {'script tok/s':>12} {'rank':>4} {'synthetic tok/s':>15} {'rank':>4}")
    for row in rows:
        print(
            f"{row['config']:<10} {row['script']['median_tokens_per_s']:12.1f} {row['script']['rank'] or '-':>4} "
            f"{row['synthetic']['median_tokens_per_s']:15.1f} {row['synthetic']['rank'] or '-':>4}"
        )
    print(
        f"rank correlation (Spearman) {spearman:+.2f}; same fastest config: "
        f"{rankings['script'][:1] == rankings['synthetic'][:1]}; seconds a trial costs beyond its timed steps "
        f"(median): script {overhead['script']:.1f}, synthetic {overhead['synthetic']:.1f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": f"python bench/script_mode.py --rounds {args.rounds}",
                "rows": rows,
                "rankings": rankings,
                "spearman": spearman,
                "beyond_timed_steps_s_median": overhead,
            },
            indent=2,
        )
        + "\n"
    )


def _spearman(a: list[str], b: list[str]) -> float:
    common = [name for name in a if name in b]
    n = len(common)
    if n < 2:
        return float("nan")
    ra = {name: i for i, name in enumerate(x for x in a if x in common)}
    rb = {name: i for i, name in enumerate(x for x in b if x in common)}
    return 1 - 6 * sum((ra[x] - rb[x]) ** 2 for x in common) / (n * (n * n - 1))


if __name__ == "__main__":
    main()
