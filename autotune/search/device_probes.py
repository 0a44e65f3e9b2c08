"""What the search measures about the device once per study, before ranking: the matmul speed of each
precision, and the roofline the step-time model times against. Both are stored on the study, so a resumed
search and the other workers read them rather than probe again."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna

    from autotune.estimate.step_time import DeviceProfile
    from autotune.search.backends import TrialBackend

__all__ = ["PROBE_KEY", "ROOFLINE_KEY", "precision_speed", "device_profile"]

PROBE_KEY = "device_probe"  # study user attribute: matmul speed per precision relative to fp32
ROOFLINE_KEY = "device_roofline"  # study user attribute: the device profile the step-time model times against


def precision_speed(study: optuna.Study, backend: TrialBackend, precisions: tuple[str, ...]) -> dict[str, float] | None:
    """The device's matmul speed per precision the space offers, probed once per study (stored)."""
    if len(precisions) < 2:
        return None
    stored = study.user_attrs.get(PROBE_KEY) or {}
    if stored.get("asked") != sorted(precisions):
        probe = getattr(backend, "probe", None)
        stored = {"asked": sorted(precisions), "speed": probe(list(precisions)) if probe is not None else None}
        study.set_user_attr(PROBE_KEY, stored)
    return stored["speed"] or None


def device_profile(study: optuna.Study, backend: TrialBackend, *, ranks: int) -> DeviceProfile | None:
    """This device's roofline (matmul FLOP/s per dtype, bandwidth, per-operator time), probed once per
    study and stored; None where the backend cannot probe or the probe failed. The latency of a
    collective between ranks (two more processes on a CPU, seconds) only where the study's trials
    have several ranks: one rank communicates nothing, and the study's workload is fixed."""
    from autotune.estimate.step_time import DeviceProfile

    if ROOFLINE_KEY not in study.user_attrs:
        probe = getattr(backend, "profile", None)
        probed = probe(between_ranks=ranks > 1, stored=lambda: study.user_attrs.get(ROOFLINE_KEY)) if probe else None
        study.set_user_attr(ROOFLINE_KEY, probed or {})
    stored = study.user_attrs[ROOFLINE_KEY]
    return DeviceProfile.from_dict(stored) if stored else None
