"""What PyTorch FSDP2 (``fully_shard``) really holds on one CUDA device, by stream, for a 3B Llama's training step.

autotune's estimator replays FSDP2's allocations through a model of the caching allocator with one pool per
stream (``autotune/estimate/cuda_allocator.py``) and sizes FSDP2's buffers by arithmetic
(``autotune/estimate/fsdp_buffers.py``; ``bench/fsdp2_cuda_memory.md`` reads the sources). Both are checked
against this measurement: FSDP2 over a world of one rank (NCCL, an in-process store), each decoder layer one
``fully_shard`` unit and then the root, with the reshard flag and mixed-precision policy autotune's trials use
(``autotune/prepare/sharding.py``: fp32 master parameters, bf16 compute copies), and the step of autotune's
trials (``autotune/trial/engine.py``: forward and loss under bf16 autocast, backward, ``torch.optim.AdamW``,
``zero_grad(set_to_none=True)``): one warm-up step, two timed ones. Per
config, in a fresh process each, so the caching allocator starts empty:

* ``max_memory_allocated``, ``max_memory_reserved``, ``num_alloc_retries``, the step time and tokens/s;
* the allocator's segments grouped by their ``stream`` (the compute stream against FSDP2's all-gather and
  reduce-scatter streams, named from the root's ``FSDPCommContext``), after the last step and at the peak of
  allocated memory (the allocator's history, ``torch.cuda.memory._record_memory_history``, replayed);
* the model states as arithmetic (parameters, gradients and AdamW's two moments, fp32 each), so the residual
  (activations and temporaries) reads off.

What one rank shows and what it does not. The reduce-scatter side is as at N ranks: ``foreach_reduce``
allocates the input, the whole group in ``reduce_dtype``, on the compute stream at any N, and the output, 1/N
of it (here all of it: the reduce-scatter becomes a copy), on the reduce-scatter stream, where the sharded
gradients then live. The all-gather side is not: PyTorch's ``FSDPParamGroup.unshard`` (2.13's, and the
releases since it gained a world-size-1 branch) skips ``foreach_all_gather`` at one rank and copies each shard
into its unsharded parameter on the compute stream, so the copy-in stream holds nothing. The output says which
path the installed release took, and the JSON gives a group's all-gather output (root and a layer, bf16):
what the copy-in stream would hold at N ranks.

On the GPU machine (one card; made to end in under 150 s, 3B Llama, seq 2048, micro batch 1):

    python bench/fsdp2_one_gpu.py      # writes bench/results/fsdp2_one_gpu_<card>.txt and .json

If the 28-layer model's first config shows the rest would not fit the time budget (``--budget``), the later
configs run with ``--fallback-layers`` decoder layers (8), each row saying how many it had. On a CPU,
``--rehearse`` runs the same code on a tiny Llama (gloo, 2 layers, hidden 64, vocab 512, seq 64), one step each,
with no CUDA figure: it proves the commands work (it writes files only with ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_JSON = ROOT / "bench" / "data" / "published" / "llama-3.2-3b.json"
# The rehearsal's Llama: the same config file with these sizes, small enough for a CPU step in a second.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "num_hidden_layers": 2,
}
GiB = 2**30
# The allocator's history without tracebacks: a few events a tensor, never near this cap in three steps.
MAX_HISTORY = 5_000_000
# FSDPCommContext's streams (``_fsdp_param_group.py``), short names for the table.
FSDP_STREAMS = {
    "all_gather_copy_in_stream": "ag-in",
    "all_gather_stream": "ag",
    "reduce_scatter_stream": "rs",
    "all_reduce_stream": "ar",
}


@dataclass(frozen=True)
class RunConfig:
    """One measured config; each runs in a process of its own."""

    label: str
    checkpointing: bool
    reshard_after_forward: bool
    reduce_dtype: str  # "float32" or "bfloat16"
    seq_len: int = 2048
    micro_batch: int = 1
    layers: int | None = None  # None: the config file's
    warmup_steps: int = 1
    timed_steps: int = 2
    rehearse: bool = False


# The order is the order of value: should time run short, the first rows are the ones that land.
CONFIGS = [  # label, checkpointing, reshard_after_forward, reduce_dtype
    RunConfig("ckpt off, reshard, fp32 reduce", False, True, "float32"),
    RunConfig("ckpt on, reshard, fp32 reduce", True, True, "float32"),
    RunConfig("ckpt off, no reshard, fp32 reduce", False, False, "float32"),
    RunConfig("ckpt on, no reshard, fp32 reduce", True, False, "float32"),
    RunConfig("ckpt off, reshard, bf16 reduce", False, True, "bfloat16"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="on a CPU: a tiny Llama, gloo, one step per config")
    parser.add_argument("--out", type=Path, help="results .txt (and .json beside it); default bench/results/...")
    parser.add_argument("--budget", type=float, default=140.0, help="seconds the whole run may take (default 140)")
    parser.add_argument("--fallback-layers", type=int, default=8, help="decoder layers when 28 would not fit")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a RunConfig as JSON: measure it, in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # where the child writes its figures
    args = parser.parse_args()
    if args.child:
        config = RunConfig(**json.loads(args.child))
        args.result.write_text(json.dumps(measure(config)))
        return
    run_all(args)


# --------------------------------------------------------------------------------------------------- the parent


def run_all(args: argparse.Namespace) -> None:
    """Each config in a fresh process, within the time budget; the table and JSON rewritten as each lands (a
    lease that ends early still leaves the rows before)."""
    started = time.monotonic()
    deadline = started + args.budget
    configs = (
        [replace(c, rehearse=True, seq_len=64, warmup_steps=0, timed_steps=1) for c in CONFIGS]
        if args.rehearse
        else CONFIGS
    )
    command = "python bench/fsdp2_one_gpu.py" + (" --rehearse" if args.rehearse else "")
    results: list[dict[str, Any]] = []
    layers: int | None = None  # None: the config file's
    per_run: float | None = None  # the wall time of the last config that ran at ``layers``
    for index, config in enumerate(configs):
        remaining = deadline - time.monotonic()
        # The first full-size row tells what one costs (its cold start, files and CUDA, a little more than the
        # next); when the rest would overrun, they run on fewer layers. Asked again before each config.
        if not args.rehearse and layers is None and per_run is not None:
            if per_run * (0.8 if index == 1 else 1.0) * (len(configs) - index) > remaining - 5:
                layers, per_run = args.fallback_layers, per_run * 0.6
        if results and remaining < 0.8 * (per_run or 30.0):
            results.append({"config": asdict(config), "error": f"skipped: {remaining:.0f} s of the budget left"})
            continue
        run = replace(config, layers=layers)
        # The first config may take half the budget at most, so a slow start still leaves time for fallback rows.
        limit = max(5.0, remaining - 2.0 if results else min(remaining - 2.0, args.budget / 2))
        result = run_child(run, limit)
        results.append(result)
        if "error" in result:
            if not args.rehearse and layers is None:
                layers = args.fallback_layers  # the full model ran past its limit (or out of memory)
            print(f"{run.label}: {result['error']}", flush=True)
        else:
            per_run = result["wall_s"]
            print(f"{run.label}: {per_run:.1f} s", flush=True)
        write(args, command, results, time.monotonic() - started)
    # Rows on fewer layers need their own baseline: the first config again at that size, if time is left.
    if layers is not None and len(results) > 1 and deadline - time.monotonic() > 1.2 * (per_run or 30.0):
        run = replace(configs[0], layers=layers)
        results.append(run_child(run, deadline - time.monotonic() - 2.0))
        print(f"{run.label} ({layers} layers): {results[-1].get('error', 'done')}", flush=True)
    lines = write(args, command, results, time.monotonic() - started)
    print("\n".join(lines))


def run_child(config: RunConfig, limit_s: float) -> dict[str, Any]:
    """``config`` measured in a new Python process (an empty caching allocator), killed after ``limit_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", json.dumps(asdict(config)), "--result", str(result_path)]
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
        began = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"config": asdict(config), "error": f"killed after {limit_s:.0f} s"}
        wall = time.monotonic() - began
        if proc.returncode != 0 or not result_path.exists():
            lines = proc.stderr.strip().splitlines()
            tail = " | ".join(lines[-3:])[-400:]
            error = f"exit {proc.returncode}: {tail}"
            return {"config": asdict(config), "error": error, "stderr_tail": lines[-40:], "wall_s": wall}
        result: dict[str, Any] = json.loads(result_path.read_text())
    result["wall_s"] = wall
    return result


def write(args: argparse.Namespace, command: str, results: list[dict[str, Any]], elapsed: float) -> list[str]:
    """The table, printed at the end; written to ``--out`` (default beside the other results; the rehearsal
    writes only where ``--out`` says)."""
    first = next((r for r in results if "error" not in r), {})
    card = "rehearsal on the CPU (no CUDA figure)" if args.rehearse else first.get("device", "unknown card")
    lines = [f"# {command}: {card}; torch {first.get('torch', '?')}, transformers {first.get('transformers', '?')}"]
    if first:
        lines.append(
            f"Llama from {MODEL_JSON.relative_to(ROOT)}{' (tiny sizes)' if args.rehearse else ''}, seq "
            f"{first['config']['seq_len']}, micro batch {first['config']['micro_batch']}; FSDP2 over 1 rank "
            f"({first['backend']}), each decoder layer a unit, then the root; param bf16 (fp32 masters) under bf16 "
            "autocast, AdamW; "
            f"{first['config']['warmup_steps']} warm-up + {first['config']['timed_steps']} timed steps; "
            f"PYTORCH_CUDA_ALLOC_CONF={first.get('alloc_conf') or '(unset)'}"
        )
    lines += table(results)
    lines.append(f"total {elapsed:.1f} s (budget {args.budget:.0f} s)")
    fewer = [f"'{r['config']['label']}'" for r in results if r["config"].get("layers") is not None]
    if fewer:
        lines.append(
            f"fallback: {', '.join(fewer)} ran with {args.fallback_layers} decoder layers, not the file's: at its "
            "size the whole run would have overrun the budget (or the first config failed; see its row)"
        )
    if first:
        lines.append(f"all-gather at one rank: {first['all_gather_path']}")
    if args.rehearse:
        lines.append(
            "rehearsal: on the GPU the same processes build the 28-layer 3B Llama on CUDA over NCCL and add "
            "max_memory_allocated/reserved, num_alloc_retries and the segments' reserved bytes by stream "
            "(after the last step and at the allocated peak)"
        )
    if args.out or not args.rehearse:
        card_name = str(first.get("device", "unknown")).replace(" ", "_")
        out = args.out or ROOT / "bench" / "results" / f"fsdp2_one_gpu_{card_name}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        summary = {"command": command, "elapsed_s": elapsed, "budget_s": args.budget, "results": results}
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return lines


def table(results: list[dict[str, Any]]) -> list[str]:
    """One row a config: GiB, the per-stream columns the reserved bytes of each stream's segments (end of the
    last step) and the allocated bytes of each stream at the allocated peak."""

    def gib(value: float | None) -> str:
        return "-" if value is None else f"{value / GiB:.2f}"

    head = (
        f"{'config':<34} {'L':>3} {'states':>7} {'resid':>6} {'alloc':>7} {'resv':>7} {'retry':>5} "
        f"{'resv:def':>8} {'rs':>6} {'ag-in':>6} {'other':>6} {'pk:def':>7} {'rs':>6} {'step s':>7} {'tok/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        label = r["config"]["label"]
        if "error" in r:
            lines.append(f"{label:<34} {r['error']}")
            continue
        cuda = r.get("cuda") or {}
        end = cuda.get("end", {}).get("reserved_by_stream", {})
        peak = cuda.get("at_peak", {}).get("allocated_by_stream", {})
        named = {"default", "rs", "ag-in"}
        other = sum(v for k, v in end.items() if k not in named) if end else None
        states = r["state_bytes"]["total"]
        alloc = cuda.get("max_allocated")
        lines.append(
            f"{label:<34} {r['layers']:>3} {gib(states):>7} {gib(alloc - states if alloc else None):>6} "
            f"{gib(alloc):>7} {gib(cuda.get('max_reserved')):>7} {cuda.get('num_alloc_retries', '-'):>5} "
            f"{gib(end.get('default') if cuda else None):>8} {gib(end.get('rs') if cuda else None):>6} "
            f"{gib(end.get('ag-in') if cuda else None):>6} {gib(other):>6} "
            f"{gib(peak.get('default') if peak else None):>7} {gib(peak.get('rs') if peak else None):>6} "
            f"{r['step_time_s']:>7.3f} {r['tokens_per_s']:>8.0f}"
        )
    lines.append(
        "states: fp32 params + grads + AdamW moments (numel x 16 B); resid: max alloc - states; resv:<stream>: "
        "segments' bytes by stream after the last step; pk:<stream>: allocated by stream at the allocated peak"
    )
    return lines


# ---------------------------------------------------------------------------------------------------- the child


def measure(config: RunConfig) -> dict[str, Any]:
    """Build, shard and step one config in this process; its figures as a JSON-able dict."""
    began = time.monotonic()
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = not config.rehearse
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible: run with --rehearse on a CPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    history = False
    if cuda:
        torch.cuda.set_device(device)
        # Before any allocation, so the replayed history starts from an empty allocator.
        history = start_history(torch)
    fields = json.loads(MODEL_JSON.read_text())
    fields.pop("architectures", None)
    fields.update(TINY if config.rehearse else {})
    if config.layers is not None:
        fields["num_hidden_layers"] = config.layers
    model_config = AutoConfig.for_model(fields.pop("model_type"), **fields, use_cache=False)
    # Parameters on the meta device (their random values made later, on the device, one shard each);
    # buffers (the rotary frequencies) stay real, as in autotune's trials.
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa").to(torch.float32)
    model.train()
    if config.checkpointing:
        enable_checkpointing(model)

    # One rank: an in-process store, so no port can collide with anything else on the machine.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    backend = "nccl" if cuda else "gloo"
    store = dist.HashStore()  # type: ignore[attr-defined]  # re-exported from c10d at run time, not in the stubs
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,))
        reduce_dtype = getattr(torch, config.reduce_dtype)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        layers = list(model.model.layers)
        layer_numel = sum(p.numel() for p in layers[0].parameters())
        total_numel = sum(p.numel() for p in model.parameters())  # a tied embedding counts once
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy)
        # The root too, as autotune's trials (shard_model) do: the same reshard flag.
        fully_shard(model, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy)
        materialise(model, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        draws = torch.Generator(device=device).manual_seed(0)
        shape = (config.micro_batch, config.seq_len)
        ids = torch.randint(model_config.vocab_size, shape, device=device, generator=draws)
        built = time.monotonic() - began

        step_s: list[float] = []
        loss = float("nan")
        for _ in range(config.warmup_steps + config.timed_steps):
            synchronize(torch, cuda)
            t0 = time.perf_counter()
            # autotune's trial step (TrainingEngine._step): bf16 autocast beside the policy, the output object
            # dropped at once (only the loss kept), zero_grad(set_to_none=True) after the step.
            with torch.autocast(device.type, dtype=torch.bfloat16):
                step_loss = model(input_ids=ids, labels=ids).loss
            step_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(torch, cuda)
            step_s.append(time.perf_counter() - t0)
            loss = float(step_loss.detach())
        timed = step_s[config.warmup_steps :]
        step_time = sum(timed) / len(timed)

        result: dict[str, Any] = {
            "config": asdict(config),
            "layers": len(layers),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "backend": backend,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "nccl_avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS"),
            "params": total_numel,
            "layer_params": layer_numel,
            "root_params": total_numel - layer_numel * len(layers),
            # fp32 parameters, fp32 sharded gradients (the reduce-scatter output, or its fp32 cast under a bf16
            # reduction) and AdamW's exp_avg and exp_avg_sq, fp32 each.
            "state_bytes": {
                "params": total_numel * 4,
                "grads": total_numel * 4,
                "adamw": total_numel * 8,
                "total": total_numel * 16,
            },
            # One group's all-gather output in bf16 (at N ranks, on the copy-in stream; absent at one rank).
            "all_gather_output_bytes": {
                "layer": layer_numel * 2,
                "root": (total_numel - layer_numel * len(layers)) * 2,
            },
            "all_gather_path": all_gather_path(model, mesh),
            "build_s": built,  # the process start to the first step: imports, build, shard, materialise
            "step_s": step_s,
            "step_time_s": step_time,
            "tokens_per_s": config.micro_batch * config.seq_len / step_time,
            "loss": loss,
            "cuda": cuda_figures(torch, model, history) if cuda else None,
        }
    finally:
        dist.destroy_process_group()
    return result


def synchronize(torch_module: Any, cuda: bool) -> None:
    if cuda:
        torch_module.cuda.synchronize()


def start_history(torch_module: Any) -> bool:
    """Record the allocator's events (no tracebacks: a few microseconds an event); False where this torch
    lacks the private API (the segments at the end are still read through the public ``memory_snapshot``)."""
    record = getattr(torch_module.cuda.memory, "_record_memory_history", None)
    if record is None:
        return False
    try:
        record(enabled="all", context=None, stacks="python", max_entries=MAX_HISTORY)
    except (TypeError, RuntimeError):
        return False
    return True


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lives on the meta device; buffers stay where they are made (each
    parameter is made on the CPU, uninitialised, and moved at once: one at a time at most)."""
    import torch

    register = torch.nn.Module.register_parameter

    def register_on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        kept = self._parameters[name]
        if kept is not None and kept.device.type != "meta":
            self._parameters[name] = torch.nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing of each decoder layer, through Transformers' own switch as autotune's trials
    do (its newer name first: Transformers 5.24 renamed it, the old one warns)."""
    for name, kwargs in (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
    ):
        enable = getattr(model, name, None)
        if callable(enable):
            enable(**{kwargs: {"use_reentrant": False}})
            return
    raise SystemExit(f"{type(model).__name__} has no checkpointing switch")


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    """The meta parameters made on ``device`` (one shard each: FSDP2 sharded them on meta), drawn in place on
    the device. ``to_empty`` would replace the real buffers FSDP2 moved to the device with empty ones, so
    they go back."""
    import torch

    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    model.to_empty(device=device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    draws = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            # The local shard, not the DTensor: no DTensor random-number tracker involved.
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.dim() == 1:
                local.fill_(1.0)  # norms' weights
            else:
                local.normal_(0.0, 0.02, generator=draws)


def fsdp_stream_names(model: torch.nn.Module) -> dict[int, str]:
    """The CUDA stream handles of the root's ``FSDPCommContext`` (shared by every unit after lazy init), by
    the short names of the table. Private attributes: an empty mapping where a release names them otherwise."""
    get_state = getattr(model, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    comm = getattr(state, "_comm_ctx", None)
    names: dict[int, str] = {}
    for attribute, short in FSDP_STREAMS.items():
        stream = getattr(comm, attribute, None)
        handle = getattr(stream, "cuda_stream", None)
        if isinstance(handle, int):
            names.setdefault(handle, short)
    return names


def all_gather_path(model: torch.nn.Module, mesh: Any) -> str:
    """Which unshard ran, read from the installed ``FSDPParamGroup.unshard``: recent releases skip
    ``foreach_all_gather`` at world size 1 (the all-gather output, on the copy-in stream at N ranks, never
    exists then); older ones all-gather over the one rank."""
    import inspect

    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        source = inspect.getsource(_fsdp_param_group.FSDPParamGroup.unshard)
    except (ImportError, OSError, TypeError, AttributeError):
        return "unknown (FSDPParamGroup.unshard's source not readable)"
    if mesh.size() == 1 and "world_size == 1" in source:
        return (
            "skipped at world size 1 (FSDPParamGroup.unshard copies each shard on the compute stream: no "
            "all-gather output, nothing on the copy-in stream; see all_gather_output_bytes for N ranks)"
        )
    return "foreach_all_gather over one rank (the output on the copy-in stream, as at N ranks)"


def cuda_figures(torch_module: Any, model: torch.nn.Module, history: bool) -> dict[str, Any]:
    """The allocator's counters, its segments by stream after the last step, and (from the recorded history)
    each stream's allocated and reserved bytes at the moment of the allocated peak and at its own peak."""
    torch = torch_module
    names = {0: "default", torch.cuda.default_stream().cuda_stream: "default"}
    names.update(fsdp_stream_names(model))

    def name(stream: int) -> str:
        return names.get(stream) or f"stream {stream:#x}"

    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    figures: dict[str, Any] = {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "allocated_end": torch.cuda.memory_allocated(),
        "reserved_end": torch.cuda.memory_reserved(),
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "num_ooms": stats.get("num_ooms"),
        # The device's own figure: the CUDA context and NCCL's buffers (none made at one rank) beside the cache.
        "device_used": total - free,
        "streams": {f"{handle:#x}": short for handle, short in names.items()},
    }
    snapshot: dict[str, Any] | None = None
    if history:
        try:
            snapshot = torch.cuda.memory._snapshot()
        except (RuntimeError, AttributeError):
            snapshot = None
        torch.cuda.memory._record_memory_history(enabled=None)
    segments = snapshot["segments"] if snapshot else torch.cuda.memory_snapshot()
    reserved: dict[str, int] = defaultdict(int)
    allocated: dict[str, int] = defaultdict(int)
    for segment in segments:
        reserved[name(segment["stream"])] += segment["total_size"]
        allocated[name(segment["stream"])] += segment["allocated_size"]
    figures["end"] = {"reserved_by_stream": dict(reserved), "allocated_by_stream": dict(allocated)}
    traces = (snapshot or {}).get("device_traces") or []
    if traces:
        trace = traces[torch.cuda.current_device()] if len(traces) > 1 else traces[0]
        figures.update(replay(trace, name))
        figures["history_complete"] = len(trace) < MAX_HISTORY
    return figures


def replay(trace: list[dict[str, Any]], name: Any) -> dict[str, Any]:
    """The history replayed: allocated and reserved bytes by stream at the allocated peak and at the reserved
    peak, and each stream's own peaks. Sizes are the trace's (requested bytes: a little under the allocator's
    rounded blocks, which ``max_memory_allocated`` counts)."""
    live: dict[int, tuple[int, str]] = {}
    allocated: dict[str, int] = defaultdict(int)
    reserved: dict[str, int] = defaultdict(int)
    own_alloc: dict[str, int] = defaultdict(int)
    own_resv: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    total_alloc = total_resv = peak_alloc = peak_resv = 0
    at_alloc_peak: dict[str, Any] = {}
    at_resv_peak: dict[str, Any] = {}
    for entry in trace:
        action = entry.get("action")
        size = int(entry.get("size", 0))
        stream = name(int(entry.get("stream", 0)))
        if action == "alloc":
            live[entry["addr"]] = (size, stream)
            allocated[stream] += size
            total_alloc += size
            count[stream] += 1
            own_alloc[stream] = max(own_alloc[stream], allocated[stream])
        elif action == "free_requested":  # where allocated_bytes drops; the block may wait for events
            size, stream = live.pop(entry["addr"], (0, stream))
            allocated[stream] -= size
            total_alloc -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved[stream] += size
            total_resv += size
            own_resv[stream] = max(own_resv[stream], reserved[stream])
        elif action in ("segment_free", "segment_unmap"):
            reserved[stream] -= size
            total_resv -= size
        else:
            continue
        if total_alloc > peak_alloc:
            peak_alloc = total_alloc
            at_alloc_peak = {"allocated_by_stream": dict(allocated), "reserved_by_stream": dict(reserved)}
        if total_resv > peak_resv:
            peak_resv = total_resv
            at_resv_peak = {"allocated_by_stream": dict(allocated), "reserved_by_stream": dict(reserved)}
    return {
        "at_peak": {"replayed_allocated": peak_alloc, **at_alloc_peak},
        "at_reserved_peak": {"replayed_reserved": peak_resv, **at_resv_peak},
        "stream_peaks": {"allocated": dict(own_alloc), "reserved": dict(own_resv)},
        "allocations_by_stream": dict(count),
        "history_entries": len(trace),
    }


if __name__ == "__main__":
    main()
