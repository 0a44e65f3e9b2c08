"""Where a Hopper card's training step goes, kernel by kernel, against the step-time model's parts.

The H100 rows of bench/plan_published.py read 16-36% fast and the A100 rows of the same code 5-16%; on an
H200, autotune's own 3B trials read 23-26% fast (bench/results/gpu_check_NVIDIA_H200.txt). A whole step's
error does not say which part of the model is wrong. This script measures the parts on one card, with no
collective in the way: for each config of ``CONFIGS`` (the llm-foundry H100 rows' models and micro batches, on
one GPU), autotune's own trial engine (autotune.trial.engine, as ``autotune trial`` builds it) is stepped, timed,
and profiled for one step, and each kernel is put in the step-time model's kinds:

- matmul: cuBLAS and CUTLASS GEMMs (names with gemm, xmma, nvjet, cutlass, wgmma)
- attention: the fused attention kernels (flash, fmha, attention)
- other: every other kernel of the forward and backward (elementwise, reductions, norms, copies, the loss)
- update: the kernels inside ``Optimizer.step`` and ``zero_grad``
- idle: the step's wall time no kernel ran (the host's dispatch where it is slower than the kernels)

Beside them, the model's prediction for the same config on the same card (``--predict-for``, made on any
machine beforehand, so that the GPU's minutes measure), and two microbenchmarks: PyTorch's flash SDPA forward
and backward at each config's shape against the card's peak, and a large elementwise kernel's bandwidth.

    python bench/gpu_step_parts.py --predict-for H200   # any machine: results/gpu_step_parts_predicted_H200.json
    python bench/gpu_step_parts.py                      # the GPU: results/gpu_step_parts_<card>.txt
    python bench/gpu_step_parts.py --rehearse           # a CPU: the same steps on a tiny model, no figure
    python bench/gpu_step_parts.py --recheck H200       # any machine: a lease's figures against today's model
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_readings import Readings  # bench/gpu_readings.py

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = "bench/data/published"
# (label, model config, seq len, micro batch, checkpointing, compile): F4 760m's and F4 1b's model and micro
# batch (llm-foundry's H100 table), an attention-heavy step like S6's and F2 7b/8192's, each on one card; and
# F4 1b's and the Llama's compiled (Inductor's Triton kernels in place of eager PyTorch's, as S2, S5 and S6 ran).
CONFIGS = [
    ("MPT-760m seq 2048 mb24", f"{PUBLISHED}/mpt-760m.json", 2048, 24, False, False),
    ("MPT-1b seq 2048 mb14", f"{PUBLISHED}/mpt-1b.json", 2048, 14, False, False),
    ("Llama-3.2-3B seq 8192 mb2 ckpt", f"{PUBLISHED}/llama-3.2-3b.json", 8192, 2, True, False),
    ("MPT-1b seq 2048 mb14 compiled", f"{PUBLISHED}/mpt-1b.json", 2048, 14, False, True),
    # Not measured yet: the compiled torchtitan rows (S2, S6) read 24-26% fast where the eager ones read 8%.
    ("Llama-3.2-3B seq 8192 mb2 ckpt compiled", f"{PUBLISHED}/llama-3.2-3b.json", 8192, 2, True, True),
]
REHEARSAL = [("gpt2-tiny seq 64 mb4", "builtin:gpt2-tiny", 64, 4, False, False)]
Config = tuple[str, str, int, int, bool, bool]
KINDS = ("matmul", "attention", "other", "update", "idle")
_ATTENTION_KERNEL = re.compile(r"flash|fmha|attention", re.IGNORECASE)
_MATMUL_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|cublas", re.IGNORECASE)


def workload_and_config(model: str, seq: int, mb: int, ckpt: bool, compiled: bool, gpu: str | None) -> tuple[Any, Any]:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

    workload = Workload(model=model, task="causal-lm", seq_len=seq, global_batch=mb, gpu=gpu)
    config = TrialConfig(micro_batch=mb, precision="bf16", checkpointing=ckpt, attention="sdpa", compile=compiled)
    return workload, config


def predict(card: str, configs: list[Config]) -> dict[str, Any]:
    """Each config's predicted step on ``card``, in the kinds the profile is read in (seconds)."""
    from plan_published import kind_split  # bench/plan_published.py: one micro step's seconds per kind

    from autotune.config.gpus import gpu_spec
    from autotune.estimate import step_time
    from autotune.estimate.client import predict_memory

    profile = step_time.card_profile(gpu_spec(card))
    out = {}
    for label, model, seq, mb, ckpt, compiled in configs:
        workload, config = workload_and_config(model, seq, mb, ckpt, compiled, card)
        estimate = predict_memory(workload, config, timeout_s=1800)
        timed = step_time.predict_step_time(estimate, workload, profile)
        assert timed is not None and estimate.step_costs is not None, f"{label}: no traced step costs"
        parts = {**kind_split(estimate, profile), "update": timed.update_s}
        out[label] = {
            "step_s": timed.step_s,
            "tokens_per_s": timed.tokens_per_s,
            "parts_s": parts,
            "allocated": estimate.predicted_peak_bytes,
            "reserved": estimate.predicted_reserved_bytes,
        }
        print(f"{label}: step {timed.step_s * 1e3:.1f} ms predicted", flush=True)
    return {"command": f"python bench/gpu_step_parts.py --predict-for {card}", "card": card, "configs": out}


def recheck(card: str, results: Path) -> list[str]:
    """A lease's measured parts (``results``, the table this script wrote) beside the model's prediction now:
    what a change to the step-time model does to the errors, without a GPU."""
    measured: dict[str, list[float]] = {}
    for line in results.read_text().splitlines():
        cells = line.split(" | ")
        label = cells[0]
        if any(label == c[0] for c in CONFIGS) and len(cells) == 7 and label not in measured:
            measured[label] = [_ms(cell.split(" / ")[1]) for cell in cells[1:6]]
    configs = [c for c in CONFIGS if c[0] in measured]
    predictions = predict(card, configs)["configs"]
    lines = [
        f"# python bench/gpu_step_parts.py --recheck {card} --results {results.relative_to(ROOT)}",
        "the lease's measured seconds against the step-time model's prediction now; predicted / measured (error)",
        "config | step | matmul | attention | other | update",
    ]
    for label, (step, *parts) in measured.items():
        p = predictions[label]
        cells = [_pair(p["step_s"], step)]
        cells += [
            _pair(p["parts_s"].get(k, 0.0), m)
            for k, m in zip(("matmul", "attention", "other", "update"), parts, strict=True)
        ]
        lines.append(" | ".join([label, *cells]))
    return lines


def _ms(text: str) -> float:
    return float(text.split()[0]) / 1e3


def kernel_parts(trace: dict[str, Any]) -> dict[str, float]:
    """Seconds of a profiled step's kernels per kind, from a torch.profiler Chrome trace.

    The update's kernels are those on the GPU timeline inside ``Optimizer.*`` annotations (PyTorch marks
    ``Optimizer.step#AdamW.step`` and ``Optimizer.zero_grad#AdamW.zero_grad`` on the device too); where a
    release marks only the host, those launched (matched by correlation id) inside the host's span.
    """
    events = trace.get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    spans = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("Optimizer.")
    ]
    in_update: set[int] = set()
    if spans:
        in_update = {i for i, k in enumerate(kernels) if any(a <= k["ts"] < b for a, b in spans)}
    else:
        host = [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("Optimizer.")
        ]
        launched = {
            e.get("args", {}).get("correlation")
            for e in events
            if e.get("cat") == "cuda_runtime" and any(a <= e["ts"] < b for a, b in host)
        }
        in_update = {i for i, k in enumerate(kernels) if k.get("args", {}).get("correlation") in launched}
    parts = dict.fromkeys(KINDS, 0.0)
    for i, kernel in enumerate(kernels):
        name, seconds = str(kernel.get("name", "")), kernel["dur"] * 1e-6
        if i in in_update:
            parts["update"] += seconds
        elif _ATTENTION_KERNEL.search(name):
            parts["attention"] += seconds
        elif kernel.get("cat") == "kernel" and _MATMUL_KERNEL.search(name):
            parts["matmul"] += seconds
        else:
            parts["other"] += seconds
    if kernels:
        first = min(k["ts"] for k in kernels)
        last = max(k["ts"] + k["dur"] for k in kernels)
        parts["idle"] = max(0.0, (last - first) * 1e-6 - sum(parts[k] for k in KINDS if k != "idle"))
    return parts


def top_kernels(trace: dict[str, Any], n: int = 12, other: bool = False) -> list[tuple[str, float, int]]:
    """The ``n`` kernels that took longest in all: (name cut to 90 characters, seconds, launches); ``other``:
    of those neither a matmul nor attention (the update's among them)."""
    totals: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        name = str(e.get("name", ""))
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        if other and (_ATTENTION_KERNEL.search(name) or _MATMUL_KERNEL.search(name)):
            continue
        entry = totals.setdefault(name[:90], [0.0, 0])
        entry[0] += e["dur"] * 1e-6
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
    return [(name, seconds, int(count)) for name, (seconds, count) in ranked]


def measure(
    label: str, model: str, seq: int, mb: int, ckpt: bool, compiled: bool, device: Any, steps: int
) -> dict[str, Any]:
    """One config's engine, as ``autotune trial`` builds it: the median step, its peaks, one step profiled."""
    import torch

    from autotune.models.sources import resolve_task
    from autotune.trial.engine import build_engine

    workload, config = workload_and_config(model, seq, mb, ckpt, compiled, None)
    engine = build_engine(workload=workload, config=config, task=resolve_task(workload), device=device, world_size=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if compiled:
        engine.compile()
    engine.warm_up()
    engine.step()
    sync()
    seconds = []
    clocks = ["clocks.sm", "power.draw", "temperature.gpu"]
    with Readings(clocks, 200, enabled=device.type == "cuda") as read:
        for _ in range(steps):
            begin = time.perf_counter()
            engine.step()
            sync()
            seconds.append(time.perf_counter() - begin)
    result: dict[str, Any] = {"step_s": statistics.median(seconds), "steps_s": seconds}
    if read.rows:
        result.update(
            sm_clock_mhz=statistics.median(read.column("clocks.sm")),
            power_w=statistics.median(read.column("power.draw")),
            temperature_c=max(read.column("temperature.gpu")),
        )
    if device.type == "cuda":
        result["allocated"] = torch.cuda.max_memory_allocated(device)
        result["reserved"] = torch.cuda.max_memory_reserved(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    result["parts_s"] = kernel_parts(trace)
    result["top_kernels"] = top_kernels(trace)
    result["top_other_kernels"] = top_kernels(trace, other=True)
    del engine, prof, trace
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def attention_rate(device: Any, seq: int, heads: int, kv_heads: int, head_dim: int, batch: int) -> float:
    """Causal flash SDPA forward + backward, in FLOP/s counting the causal half (4 b h s^2 d forward, 2.5x it
    for both): the rate the step-time model's attention efficiency stands for."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def once() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        out.backward(grad)

    seconds = _timed(once, device)
    flops = 3.5 * 4 * batch * heads * seq * seq * head_dim / 2  # forward 1, backward 2.5 (its recompute)
    return flops / seconds


def bandwidth(device: Any) -> float:
    """A large bf16 add's bytes moved per second (read two, write one): an elementwise kernel's best."""
    import torch

    n = 2**28
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    seconds = _timed(lambda: torch.add(a, b, out=out), device)
    return 3 * 2 * n / seconds


def _timed(fn: Any, device: Any, repeat: int = 10) -> float:
    import torch

    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    begin = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - begin) / repeat


def report(card: str, predictions: dict[str, Any], measured: dict[str, dict[str, Any]], extras: list[str]) -> list[str]:
    lines = [f"# python bench/gpu_step_parts.py: {card}"]
    if predictions:
        lines.append(f"predictions: {predictions['command']} (for {predictions['card']})")
    lines.append("seconds per optimizer step (one micro batch, no accumulation); predicted / measured (error)")
    lines.append("config | step | matmul | attention | other | update | idle (measured) / host (predicted)")
    for label, m in measured.items():
        if "error" in m:
            lines.append(f"{label} | failed: {m['error']}")
            continue
        p = (predictions.get("configs") or {}).get(label)
        cells = [label, _pair(p and p["step_s"], m["step_s"])]
        for kind in ("matmul", "attention", "other", "update"):
            cells.append(_pair(p and p["parts_s"].get(kind, 0.0), m["parts_s"][kind]))
        cells.append(f"{p['parts_s']['host'] * 1e3:.1f} ms / {m['parts_s']['idle'] * 1e3:.1f} ms" if p else "-")
        lines.append(" | ".join(cells))
    for label, m in measured.items():
        if "error" in m:
            continue
        clock = f", SM clock {m['sm_clock_mhz']:.0f} MHz, {m['power_w']:.0f} W" if "sm_clock_mhz" in m else ""
        memory = ""
        p = (predictions.get("configs") or {}).get(label)
        if "allocated" in m:
            memory = f", allocated {_pair(p and p['allocated'], m['allocated'], _gib)}"
            memory += f", reserved {_pair(p and p['reserved'], m['reserved'], _gib)}"
        steps = ", ".join(f"{s * 1e3:.1f}" for s in m["steps_s"])
        lines.append(f"{label}: steps {steps} ms{clock}{memory}")
        lines += [f"  {seconds * 1e3:8.2f} ms x{count:<5} {name}" for name, seconds, count in m["top_kernels"]]
        if m.get("top_other_kernels"):
            lines.append("  of the other kinds (the update's among them):")
            lines += [f"  {s * 1e3:8.2f} ms x{count:<5} {name}" for name, s, count in m["top_other_kernels"]]
    return lines + extras


def _pair(predicted: float | None, measured: float, show: Any = None) -> str:
    show = show or (lambda v: f"{v * 1e3:.1f} ms")
    if not predicted:
        return f"- / {show(measured)}"
    error = f" ({predicted / measured - 1:+.0%})" if measured else ""
    return f"{show(predicted)} / {show(measured)}{error}"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predict-for", metavar="CARD", help="no measuring: predict each config for CARD")
    parser.add_argument("--predictions", type=Path, help="a file --predict-for wrote (default: the card's, if any)")
    parser.add_argument("--rehearse", action="store_true", help="on a CPU: a tiny model, one step each")
    parser.add_argument("--out", type=Path, help="the results file")
    parser.add_argument("--recheck", metavar="CARD", help="no measuring: --results' figures against CARD's prediction")
    parser.add_argument("--results", type=Path, default=Path("bench/results/gpu_step_parts_NVIDIA_H200.txt"))
    parser.add_argument("--only", help="measure only the configs whose label contains this text")
    parser.add_argument("--no-rates", action="store_true", help="skip the attention and bandwidth microbenchmarks")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    if args.recheck:
        lines = recheck(args.recheck, (ROOT / args.results).resolve())
        print("\n".join(lines))
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
        return
    if args.predict_for:
        configs = REHEARSAL if args.rehearse else CONFIGS
        out = args.out or ROOT / "bench" / "results" / f"gpu_step_parts_predicted_{args.predict_for}.json"
        out.write_text(json.dumps(predict(args.predict_for, configs), indent=1) + "\n")
        return
    import torch

    if args.rehearse:
        device, card, configs, steps = torch.device("cpu"), "rehearsal on the CPU (no GPU figure)", REHEARSAL, 1
    elif torch.cuda.is_available():
        device, card, configs, steps = torch.device("cuda", 0), torch.cuda.get_device_name(0), CONFIGS, 5
        torch.cuda.set_device(device)
    else:
        raise SystemExit("no CUDA device is visible: run with --rehearse on a CPU")
    default = ROOT / "bench" / "results" / "gpu_step_parts_predicted_H200.json"
    path = args.predictions or (default if not args.rehearse and default.exists() else None)
    predictions = json.loads(path.read_text()) if path else {}
    out = args.out or (
        None if args.rehearse else ROOT / "bench" / "results" / f"gpu_step_parts_{card.replace(' ', '_')}.txt"
    )
    measured: dict[str, dict[str, Any]] = {}
    extras: list[str] = []
    for label, model, seq, mb, ckpt, compiled in configs:
        if args.only and args.only not in label:
            continue
        try:
            measured[label] = measure(label, model, seq, mb, ckpt, compiled, device, steps)
        except Exception as exc:  # one config's failure (an OOM, a kernel missing) leaves the others' figures
            measured[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
            gc.collect()
        print(f"{label}: {measured[label].get('step_s', measured[label].get('error'))}", flush=True)
        if out:
            out.write_text("\n".join(report(card, predictions, measured, extras)) + "\n")
    peak = 989e12  # an H100 SXM's and an H200's dense bf16 peak
    shapes = [("MPT-760m/1b shape", 2048, 12, 12, 128, 8), ("Llama-3.2-3B shape", 8192, 24, 8, 128, 2)]
    if args.no_rates:
        shapes = []
    elif args.rehearse:
        shapes = [("tiny", 64, 2, 2, 32, 2)]
    for name, seq, heads, kv, dim, batch in shapes:
        rate = attention_rate(device, seq, heads, kv, dim, batch)
        extras.append(
            f"flash SDPA fwd+bwd, {name} (b{batch} h{heads}/{kv} s{seq} d{dim}): {rate / 1e12:.0f} TFLOP/s"
            f" = {rate / peak:.0%} of 989"
        )
    if not args.no_rates:
        extras.append(f"bf16 add, 2^28 elements: {bandwidth(device) / 1e12:.2f} TB/s")
    lines = report(card, predictions, measured, extras)
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
