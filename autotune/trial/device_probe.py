"""How fast this device multiplies in each precision: a second or two of GEMMs, measured here.

The throughput model's precision prior comes from this, not from a table: on a CPU with
bfloat16 units (avx512_bf16, AMX) 16-bit matmuls run as fast as fp32 or faster, on one without
them they emulate and crawl, and on a GPU tensor cores decide; only measuring tells which. It
runs in a process of its own (``python -m autotune.trial.device_probe cpu fp32,bf16``), so the driver
never imports torch or holds a CUDA context, and prints one JSON object: precision -> matmul
speed relative to fp32 (precisions the device cannot run are left out). On a CPU it computes only
on the cores free when it starts, as a trial does. Where trials will be forked from the trial server
(:mod:`autotune.trial.server`), the probe is forked from it too: the same measurement in a process of
its own, without the seconds a new interpreter pays to import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from autotune.config.knobs import sixteen_bit_type
from autotune.levers.float8 import FLOAT8_SINCE

__all__ = [
    "probe_precisions",
    "relative_matmul_speed",
    "probe_profile",
    "profile_request",
    "measure_profile",
    "run_probe",
    "forked_probe",
]

PROBE_TIMEOUT_S = 120.0
_SIZE = {"cpu": 512, "cuda": 4096}  # big enough to be compute bound, small enough for a second
_ROUNDS = 3  # interleaved, the best of each kept: other processes only slow a run down
_RUN_S = 0.1  # seconds of matmuls per precision per round
_FAR_SLOWER = 20  # a precision this many times slower than fp32 is measured in one round: it cannot pay anyway


def probe_precisions(device_type: str, precisions: list[str], *, trial_server: bool = False) -> dict[str, float] | None:
    """Matmul speed of each precision relative to fp32 on ``device_type``; None when the probe fails.
    ``trial_server``: forked from the trial server (started if need be) unless it is turned off."""
    speeds = _in_own_process(device_type, ",".join(precisions), trial_server=trial_server)
    if not isinstance(speeds, dict):
        return None
    return {str(k): float(v) for k, v in speeds.items() if isinstance(v, (int, float)) and v > 0}


def relative_matmul_speed(device_type: str, precisions: list[str]) -> dict[str, float]:
    """In this process: best-of-rounds matmul throughput of each precision over fp32's."""
    import torch

    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    size = _SIZE.get(device.type, 512)
    wanted = sorted(set(precisions) | {"fp32"}, key=lambda p: p != "fp32")
    best: dict[str, float] = {}
    for _ in range(_ROUNDS):
        for precision in wanted:
            if precision in best and best[precision] * _FAR_SLOWER < best.get("fp32", 0.0):
                continue
            try:
                rate = _matmul_rate(torch, device, precision, size)
            except (RuntimeError, TypeError):  # the device has no such kernel: say nothing of it
                continue
            best[precision] = max(best.get(precision, 0.0), rate)
    base = best.get("fp32")
    return {p: rate / base for p, rate in best.items() if base and p in precisions}


def _matmul_rate(torch: Any, device: Any, precision: str, size: int) -> float:
    dtype = getattr(torch, sixteen_bit_type(precision) or "float32")  # bf16-true multiplies as bf16 does
    if precision == "tf32" and device.type != "cuda":
        raise RuntimeError("tf32 is a CUDA mode")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        for _ in range(2):  # the first call selects kernels and packs (an H200's first bf16 product: 0.1 s)
            start = time.perf_counter()
            a @ b
            sync()
            once_s = time.perf_counter() - start
            # A warm product that takes the whole run (a 16-bit type a CPU emulates): it is the figure.
            if once_s < _RUN_S:
                break
        else:
            return 1 / once_s
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < _RUN_S:
            a @ b
            count += 1
        sync()
        return count / (time.perf_counter() - start)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def probe_profile(device_type: str, *, between_ranks: bool = True, trial_server: bool = False) -> dict[str, Any] | None:
    """This device's roofline (:class:`autotune.estimate.step_time.DeviceProfile` as a dict), measured
    in a process of its own; None when the probe fails. ``between_ranks``: also a collective's latency
    on a CPU (two more processes, about 3 s; what only a workload of several ranks needs).
    ``trial_server``: forked from the trial server (started if need be) unless it is turned off."""
    profile = _in_own_process(device_type, profile_request(between_ranks), trial_server=trial_server)
    return profile if isinstance(profile, dict) else None


def profile_request(between_ranks: bool) -> str:
    """What :func:`run_probe` is asked for a roofline, with or without the collective between ranks."""
    return "--profile" if between_ranks else "--profile-one-rank"


def _in_own_process(device_type: str, what: str, *, trial_server: bool = False) -> Any:
    """This module run as a probe for ``what``: the JSON its last line prints, or None when it fails.
    With ``trial_server``, forked from the trial server where it runs (a server that cannot fork or dies
    leaves the probe to a new interpreter, as it leaves trials)."""
    if trial_server:
        from autotune.trial.runner import probe_in_trial_server

        forked = probe_in_trial_server(device_type, what, timeout_s=PROBE_TIMEOUT_S)
        if forked is not None:
            return forked
    command = [sys.executable, "-m", "autotune.trial.device_probe", device_type, what]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def measure_profile(device_type: str, *, between_ranks: bool = True) -> dict[str, Any]:
    """In this process: achievable matmul FLOP/s per dtype, memory bandwidth and the time of a tiny
    operator (the per-operator overhead), each the best of interleaved rounds."""
    import torch

    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    size = _SIZE.get(device.type, 512)
    dtypes = ["float32", "bfloat16", "float16"] + (["tf32"] if device.type == "cuda" else [])
    flops: dict[str, float] = {}
    elements = (64 if device.type == "cpu" else 512) * 2**20 // 4  # 64 MiB of fp32: past the caches
    a, b = torch.ones(elements, device=device), torch.ones(elements, device=device)
    step, operators = _tiny_training_step(torch, device)
    bandwidth = dispatch = 0.0
    for _ in range(_ROUNDS):
        for dtype in dtypes:
            if dtype in flops and flops[dtype] * _FAR_SLOWER < flops.get("float32", 0.0):
                continue
            try:
                rate = _matmul_rate(torch, device, "tf32" if dtype == "tf32" else _PRECISION_OF[dtype], size)
            except (RuntimeError, TypeError):
                continue
            flops[dtype] = max(flops.get(dtype, 0.0), rate * 2 * size**3)
        if device.type == "cuda" and torch.cuda.get_device_capability(0) >= FLOAT8_SINCE:
            float8 = _float8_rate(torch, device, size, sync)
            if float8 is not None:  # --float8's matmuls: e4m3 operands forward, an e5m2 one in the backward
                best = max(flops.get("float8_e4m3fn", 0.0), float8 * 2 * size**3)
                flops["float8_e4m3fn"] = flops["float8_e5m2"] = best
        bandwidth = max(bandwidth, 3 * a.numel() * 4 / _best_time(lambda: torch.add(a, b), sync))
        per_op = _best_time(step, sync) / operators
        dispatch = per_op if not dispatch else min(dispatch, per_op)
    cores = torch.get_num_threads() if device.type == "cpu" else None
    name = (
        torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else f"this CPU ({cores} core{'s' if cores != 1 else ''})"
    )
    host_link = 25e9  # measured below on a GPU; a CPU has no link to its own memory
    if device.type == "cuda":
        pinned = torch.ones(elements, pin_memory=True)
        host_link = max(
            pinned.numel() * 4 / _best_time(lambda: a.copy_(pinned, non_blocking=True), sync) for _ in range(_ROUNDS)
        )
    collective = _gloo_collective_s() if device.type == "cpu" and between_ranks else None
    return {
        "name": name,
        "type": device.type,
        "matmul_flops": flops,
        "memory_bandwidth": bandwidth,
        "kernel_s": 0.0 if device.type == "cpu" else dispatch,
        "dispatch_s": dispatch,
        **({"collective_s": collective} if collective is not None else {}),
        # gloo between ranks on one host copies through memory: a quarter of its bandwidth is a guess
        "link_bandwidth": bandwidth / 4 if device.type == "cpu" else host_link,
        "host_link_bandwidth": host_link,
        # The dense 16-bit (or fp32) peak, as MFU is counted with float8 too (torchtitan's MFU).
        "peak_flops": max((rate for dtype, rate in flops.items() if not dtype.startswith("float8")), default=None),
        "source": "measured by the device probe",
    }


_PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _float8_rate(torch: Any, device: Any, size: int, sync: Any) -> float | None:
    """Products per second of ``torch._scaled_mm`` on float8 e4m3 operands with tensorwise scales and a bf16
    output (what torchao's Float8Linear runs); None where this device or torch has no such kernel."""
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # _scaled_mm takes b column-major
    scale = torch.ones((), device=device)

    def product() -> None:
        torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)

    try:
        product()  # selects the kernel
        return 1 / _best_time(product, sync)
    except (RuntimeError, TypeError, AttributeError):
        return None


def _gloo_collective_s(rounds: int = 50) -> float | None:
    """The time of one small gloo all-reduce between two processes on this host: what each of
    DeepSpeed's bucketed collectives costs a CPU trial's ranks beyond its bytes (None if it fails)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    ranks = [context.Process(target=_gloo_rank, args=(rank, port, rounds, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    times = [results.get() for _ in range(2) if not results.empty()]
    return max(times) if len(times) == 2 and all(t is not None for t in times) else None


def _gloo_rank(rank: int, port: int, rounds: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        tensor = torch.ones(1024)
        for _ in range(5):
            dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(tensor)
        results.put((time.perf_counter() - start) / rounds)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a probe that fails says nothing
        results.put(None)


def _tiny_training_step(torch: Any, device: Any) -> tuple[Any, int]:
    """A training step of a model too small to compute anything, and its operator count: its time per
    operator is what eager PyTorch costs per operator of a real step (modules, autograd, dispatch,
    allocation), which a bare ``add`` in a loop shows a tenth of."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()) for _ in range(4)]
    model = torch.nn.Sequential(*layers).to(device)
    batch = torch.randn(2, 8, device=device)

    def step() -> None:
        model(batch).square().mean().backward()
        model.zero_grad(set_to_none=True)

    class Count(TorchDispatchMode):
        operators = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not getattr(func, "is_view", False):
                Count.operators += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return step, max(Count.operators, 1)


def _best_time(run: Any, sync: Any) -> float:
    run()  # first call: allocation, kernel selection
    sync()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _use_free_cores(device_type: str) -> None:
    """In the probe's own process: compute on the cores a trial would run on now (see autotune.trial.cpu_cores)."""
    from autotune.trial.cpu_cores import free_cores, use_cores

    cores = free_cores() if device_type == "cpu" else None
    if cores:
        import torch

        use_cores(cores, len(cores), torch)


def run_probe(device_type: str, what: str) -> Any:
    """In the probe's own process (new or forked): ``--profile``, ``--profile-one-rank`` or a comma-separated
    list of precisions, measured on the cores free now; what it prints as JSON."""
    _use_free_cores(device_type)
    if what in ("--profile", "--profile-one-rank"):
        return measure_profile(device_type, between_ranks=what == "--profile")
    return relative_matmul_speed(device_type, what.split(","))


def forked_probe(device_type: str, what: str, env: dict[str, str], *, forked: Callable[[int], None]) -> Any:
    """In a server that has imported torch already (the trial server, the estimate server): :func:`run_probe`
    in a forked child, in a process group of its own, with ``env`` for its environment; what it measured (None:
    it failed). ``forked`` hears the child's pid (its group) as soon as it exists."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _run_forked(device_type, what, env, write_end, parent)  # never returns
    os.close(write_end)
    with contextlib.suppress(PermissionError, ProcessLookupError):  # the child may have done it already
        os.setpgid(pid, pid)
    forked(pid)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(text) if os.waitstatus_to_exitcode(status) == 0 else None
    except ValueError:
        return None


def _run_forked(device_type: str, what: str, env: dict[str, str], write_end: int, parent: int) -> None:
    """In the forked child: the probe, as ``python -m autotune.trial.device_probe`` runs it; exit without teardown."""
    code = 1
    try:
        from autotune.trial.lifeline import die_with_parent, name_process

        die_with_parent(parent)
        os.setpgid(0, 0)  # its own group, with the collective's ranks it spawns: killed whole on a timeout
        name_process(PROBE_PROCESS_NAME)
        os.environ.clear()
        os.environ.update(env)
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(run_probe(device_type, what)))
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happened, this process must not return to its server's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


PROBE_PROCESS_NAME = "autotune-probe"  # what a probe forked by a server is called in ps


if __name__ == "__main__":
    print(json.dumps(run_probe(sys.argv[1], sys.argv[2])))
