"""Commands that only read a study (show, export, studies) import only what they need: a SQLite study is
read with the standard library (autotune.study.sqlite_reader) into the same summary Optuna's path gives, and
what LoRA adapts and the model's hidden size come from what the tuner stored (autotune.study.stored_facts)."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.output.exporters import FORMATS, export_config
from autotune.search.presets import load_space
from autotune.search.tuner import tune
from autotune.study.records import load_summaries, load_summary, summarize
from autotune.study.sqlite_reader import (
    ALEMBIC_REVISION,
    SCHEMA_VERSION,
    read_study_file,
)
from autotune.study.storage import display_url, load_study, open_storage
from autotune.trial.result import TrialResult, TrialStatus

HEAVY = ("torch", "transformers", "deepspeed", "peft", "optuna", "sqlalchemy")


class Scripted:
    """Trials answered from a table (tokens/s by config; "oom" or "error" for a failing one): a study with
    every kind of trial in a second, without torch."""

    def __init__(self, figures: dict[TrialConfig, float | str]) -> None:
        self.figures = figures

    def run(self, workload, config, *, measure_steps, **_):
        figure = self.figures[config]
        if figure == "oom":
            return TrialResult(
                config=config, status=TrialStatus.OOM, peak_memory_bytes=2**31, error="CPU out of memory"
            )
        if figure == "error":
            return TrialResult(config=config, status=TrialStatus.ERROR, error="Traceback ...\nValueError: boom")
        return TrialResult(
            config=config,
            status=TrialStatus.OK,
            tokens_per_s=figure * (0.9 if measure_steps > 3 else 1),
            samples_per_s=figure / 128,
            peak_memory_bytes=2**20 + config.micro_batch,
            step_time_spread=0.02 * config.micro_batch,
            measured_steps=measure_steps,
        )

    def estimate(self, workload, config):
        return None

    def probe(self, precisions):
        return None


def _space(tmp: Path, name: str, lora: str) -> object:
    (tmp / f"{name}.yaml").write_text(
        f"n_trials: 12\nknobs:\n  micro_batch: [2, 4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n{lora}"
    )
    return load_space(tmp / f"{name}.yaml")


def _scripted_study(tmp: Path, url: str, name: str, model: str, lora: str, fastest_lora: bool) -> None:
    workload = Workload(model=model, seq_len=32, global_batch=8)
    space = _space(tmp, name, lora)
    figures: dict[TrialConfig, float | str] = {}
    for params_lora in ("off", "8", "8:all-linear"):
        for micro_batch in (2, 4, 8):
            rank, _, targets = params_lora.partition(":")
            config = space.config_of(
                {
                    "micro_batch": micro_batch,
                    "precision": "fp32",
                    "checkpointing": False,
                    "zero": "off",
                    "lora": params_lora,
                }
            )
            # all-linear 20% ahead of the default targets: close enough for a re-run to compare them, far
            # enough that the search measures it (near the noise, it may stop on evidence first).
            speedup = (3 if fastest_lora and rank != "off" else 1) * (1.2 if targets else 1)
            figures[config] = 100.0 * micro_batch * speedup
    figures[next(c for c in figures if c.micro_batch == 2 and not c.uses_lora)] = "oom"
    figures[next(c for c in figures if c.micro_batch == 4 and not c.uses_lora)] = "error"
    tune(
        study=name,
        workload=workload,
        space=space,
        memory_budget_bytes=2**30,
        storage=url,
        estimate=False,
        backend=Scripted(figures),
    )


def _odd_trials(url: str, name: str) -> None:
    """What a study also holds: a trial being measured, one interrupted, one asked without a config, one skipped."""
    from optuna.trial import TrialState

    study = load_study(open_storage(url), name, url)
    config = TrialConfig(micro_batch=1).to_dict()
    with warnings.catch_warnings():
        # Asked by hand, as a worker's study_trials.ask asks (and says the same): Optuna warns that a storage's
        # heartbeat is meant for Study.optimize, which autotune does not drive its trials with.
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        running, interrupted, failed, skipped = (study.ask() for _ in range(4))
    running.set_user_attr("config", config)
    interrupted.set_user_attr("config", config)
    study.tell(interrupted, state=TrialState.FAIL)
    study.tell(failed, state=TrialState.FAIL)
    skipped.set_user_attr("config", TrialConfig(micro_batch=16).to_dict())
    skipped.set_user_attr("status", "skipped")
    skipped.set_user_attr("estimate", {"predicted_peak_bytes": 2**40})
    skipped.set_user_attr("reason", "not run: predicted peak")
    study.tell(skipped, state=TrialState.PRUNED)  # and ``running`` is left RUNNING, as a live worker's trial is


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("read")
    url = f"sqlite:///{tmp}/studies.db"
    _scripted_study(
        tmp,
        url,
        "lora",
        "builtin:gpt2-tiny",
        "  lora_rank: [off, 8]\n  lora_targets: [default, all-linear]\n",
        fastest_lora=True,
    )
    _scripted_study(tmp, url, "plain", "builtin:gpt2-tiny", "", fastest_lora=False)
    _scripted_study(tmp, url, "bert", "builtin:bert-tiny", "  lora_rank: [8]\n", fastest_lora=True)
    _odd_trials(url, "plain")
    return tmp, url


def _through_optuna(url: str, name: str):
    return summarize(load_study(open_storage(url), name, url), url=url)


def test_the_schema_this_reader_knows_is_the_installed_optunas(tmp_path):
    """A new Optuna changes its tables: this fails here, not in a user's show (which would fall back anyway)."""
    from optuna.storages._rdb import models

    storage = open_storage(f"sqlite:///{tmp_path}/fresh.db")
    assert SCHEMA_VERSION == models.SCHEMA_VERSION
    assert ALEMBIC_REVISION == storage.get_head_version() == storage.get_current_version()


@pytest.mark.parametrize("name", ["lora", "plain", "bert"])
def test_both_paths_read_the_same_summary(studies, name):
    _, url = studies
    fast = read_study_file(url, only=name)
    assert fast is not None and name in fast.studies
    assert load_summary(study=name, storage=url) == _through_optuna(url, name)
    assert load_summary(study=name, storage=url).to_dict() == _through_optuna(url, name).to_dict()


def test_the_scripted_studies_hold_every_kind_of_trial(studies):
    _, url = studies
    plain, lora = load_summary(study="plain", storage=url), load_summary(study="lora", storage=url)
    statuses = {t.status for t in plain.trials + lora.trials}
    assert {"ok", "oom", "error", "running", "interrupted", "skipped"} <= statuses
    assert lora.best.config.uses_lora and lora.certainty and any(t.decided_rank for t in lora.trials)
    assert plain.best is not None and not plain.best.config.uses_lora
    assert all(t.duration_s is not None for t in plain.trials if t.status == "ok")


def test_studies_lists_the_same_through_either_path(studies):
    _, url = studies
    fast = load_summaries(url)
    assert [s.name for s in fast] == ["bert", "lora", "plain"]
    assert fast == [_through_optuna(url, s.name) for s in fast]


def test_missing_and_foreign_studies_fail_alike_on_both_paths(studies, tmp_path):
    import optuna

    from autotune.errors import StorageError

    tmp, url = studies
    copy = tmp_path / "copy.db"
    shutil.copy(tmp / "studies.db", copy)
    copy_url = f"sqlite:///{copy}"
    optuna.create_study(storage=copy_url, study_name="not-ours")
    for name in ("nope", "not-ours"):
        with pytest.raises(StorageError) as fast:
            load_summary(study=name, storage=copy_url)
        with pytest.raises(StorageError) as slow:
            _through_optuna(copy_url, name)
        assert str(fast.value) == str(slow.value)
    assert [s.name for s in load_summaries(copy_url)] == ["bert", "lora", "plain"]


def test_anything_this_reader_does_not_know_goes_through_optuna(studies, tmp_path):
    tmp, url = studies
    assert read_study_file(f"{url}?timeout=5") is None
    assert read_study_file("postgresql://user:secret@localhost/db") is None
    assert read_study_file(f"sqlite:///{tmp_path}/missing.db") is None
    (tmp_path / "junk.db").write_text("not a database")
    assert read_study_file(f"sqlite:///{tmp_path}/junk.db") is None
    for table, column, value in (
        ("version_info", "schema_version", SCHEMA_VERSION + 1),
        ("alembic_version", "version_num", "v9.9.9.z"),
    ):
        changed = tmp_path / f"{table}.db"
        shutil.copy(tmp / "studies.db", changed)
        with sqlite3.connect(changed) as connection:
            connection.execute(f"UPDATE {table} SET {column} = ?", (value,))
        connection.close()
        assert read_study_file(f"sqlite:///{changed}") is None
    # A schema this code does not know, but Optuna reads: the summary still comes, through Optuna.
    assert load_summary(study="plain", storage=f"sqlite:///{tmp_path}/version_info.db").n_trials > 0


def test_the_reader_opens_the_file_read_only(studies, tmp_path):
    tmp, _ = studies
    copy = tmp_path / "ro.db"
    shutil.copy(tmp / "studies.db", copy)
    before = copy.read_bytes()
    copy.chmod(0o400)
    try:
        assert read_study_file(f"sqlite:///{copy}", only="plain") is not None
    finally:
        copy.chmod(0o600)
    assert copy.read_bytes() == before


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///storage/autotune.db",
        "sqlite:////tmp/a b/x.db",
        "sqlite:///~/s.db",
        "sqlite:///a%20b.db",
        "sqlite:///x.db?timeout=3",
        "postgresql://u:pw@h/db",
    ],
)
def test_display_url_without_sqlalchemy_shows_what_sqlalchemy_shows(url):
    from sqlalchemy.engine import make_url

    assert display_url(url) == make_url(url).render_as_string(hide_password=True)


# -- what the tuner stored about the model ----------------------------------------------------------------
def test_stored_facts_give_the_exports_the_model_gives(studies):
    """Every format, from the facts stored at tune time and worked out afresh (as for an older study), alike."""
    from autotune.study import stored_facts

    _, url = studies
    for name in ("lora", "plain", "bert"):
        summary = load_summary(study=name, storage=url)  # remembers the study's facts
        assert summary.workload in stored_facts._KNOWN
        configs = [t.config for t in summary.trials if t.status == "ok"]
        configs += [
            TrialConfig(micro_batch=8, lora_rank=64, lora_alpha=16, lora_targets=t, quantize_base=q)
            for t in (None, ("all-linear",))
            for q in ("off", "nf4")
            if name != "plain"
        ]
        for fmt in FORMATS:
            for config in configs:
                if fmt == "peft" and not config.uses_lora or fmt == "bnb" and config.quantize_base == "off":
                    continue
                if fmt == "torchtitan":  # reads none of the model's facts (and refuses a CPU's config)
                    continue
                stored = export_config(config, summary.workload, fmt=fmt, device_type="cpu")
                facts = stored_facts._KNOWN.pop(summary.workload)
                try:
                    assert export_config(config, summary.workload, fmt=fmt, device_type="cpu") == stored, (name, fmt)
                finally:
                    stored_facts._KNOWN[summary.workload] = facts


def test_a_classifier_study_stores_that_its_head_trains_in_full(studies):
    _, url = studies
    best = load_summary(study="bert", storage=url).to_dict()["best"]
    assert best["trains"]["note"] == (
        "LoRA r=8 adapters, on query, value (PEFT's default targets for bert), plus the "
        "classification head in full, trained in fp32"
    )


@pytest.mark.slow
def test_a_model_lora_cannot_adapt_is_tuned_without_lora_and_says_why(tmp_path):
    """A model with no linear layer but its head: the space drops LoRA on the default targets before
    the first trial (said once), instead of measuring failures; a LoRA config's peft export refuses."""
    from autotune.config.device import detect_device
    from autotune.errors import ConfigError, WorkloadError

    url = f"sqlite:///{tmp_path}/head-only.db"
    (tmp_path / "space.yaml").write_text(
        "n_trials: 2\nknobs:\n  micro_batch: [4, 8]\n  precision: [fp32]\n"
        "  checkpointing: [false]\n  lora_rank: [null, 8]\n"
    )
    space = load_space(tmp_path / "space.yaml")
    workload = Workload(model="factories:tiny", seq_len=32, global_batch=8)
    assert space.choices(workload, detect_device("cpu"))["lora"] == ("off",)
    assert any(
        "no linear layer besides its task head" in line for line in space.dropped_knobs(workload, detect_device("cpu"))
    )
    configs = {
        space.config_of(
            {"micro_batch": mb, "precision": "fp32", "checkpointing": False, "zero": "off", "lora": "off"}
        ): 100.0 * mb
        for mb in (4, 8)
    }
    tune(
        study="s",
        workload=workload,
        space=space,
        memory_budget_bytes=2**30,
        storage=url,
        estimate=False,
        backend=Scripted(configs),
    )
    summary = load_summary(study="s", storage=url)
    assert summary.trials and all(not t.config.uses_lora for t in summary.trials)
    (tmp_path / "lora.yaml").write_text("knobs:\n  micro_batch: [8]\n  precision: [fp32]\n  lora_rank: [8]\n")
    lora_only = load_space(tmp_path / "lora.yaml")
    with pytest.raises(ConfigError, match="knobs.lora_rank \\[8\\]: .*no linear layer besides its task head"):
        lora_only.choices(workload, detect_device("cpu"))
    with pytest.raises(WorkloadError, match="no linear layer besides its task head"):
        export_config(
            space.config_of(
                {"micro_batch": 8, "precision": "fp32", "checkpointing": False, "zero": "off", "lora": "8"}
            ),
            workload,
            fmt="peft",
        )


def test_show_and_export_import_neither_torch_nor_optuna(studies):
    """Each command as the console script runs it, in one fresh interpreter; its modules checked after each."""
    tmp, url = studies
    commands = [["studies"], ["studies", "--json"]]
    commands += [["show", "--study", "lora"], ["show", "--study", "plain", "--json"], ["show", "--study", "bert"]]
    # bnb: only for a quantized base, which none of these studies holds (test_quantize's find exports one)
    unquantized = [fmt for fmt in FORMATS if fmt not in ("bnb", "torchtitan")]  # torchtitan refuses a CPU study
    commands += [["export", "--study", "plain", "--format", fmt] for fmt in unquantized if fmt != "peft"]
    commands += [["export", "--study", study, "--format", fmt] for study in ("lora", "bert") for fmt in unquantized]
    commands += [["export", "--study", "lora", "--format", "peft", "-o", str(tmp / "adapter")]]
    code = f"""
import contextlib, io, json, sys
from autotune.cli import main
from autotune.study.records import load_summaries
heavy = {HEAVY!r}
assert [s.name for s in load_summaries({url!r})] == ["bert", "lora", "plain"]  # what autotune studies lists
loaded = sys.modules.keys() & set(heavy)
assert not loaded, "load_summaries imported " + str(loaded)
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv + ["--storage", {url!r}])
    assert code == 0, (argv, err.getvalue())
    loaded = sorted(name for name in heavy if name in sys.modules)
    assert not loaded, f"autotune {{' '.join(argv)}} imported {{loaded}}"
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True, timeout=120, cwd=tmp
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert json.loads((tmp / "adapter" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.slow  # real trials: ~25 s on a busy 2-core machine
def test_a_real_tune_reads_the_same_through_either_path(tmp_path):
    (tmp_path / "space.yaml").write_text(
        "n_trials: 2\nknobs:\n  micro_batch: [4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n  lora_rank: [8]\n"
    )
    url = f"sqlite:///{tmp_path}/real.db"
    summary = tune(
        study="real",
        workload=Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=8),
        space=load_space(tmp_path / "space.yaml"),
        memory_budget_bytes=2**30,
        storage=url,
        estimate=False,
        measure_steps=2,
    )
    assert summary.best is not None and summary.best.config.uses_lora
    assert read_study_file(url, only="real") is not None
    fast = load_summary(study="real", storage=url)
    assert fast == _through_optuna(url, "real") == summary
    assert fast.to_dict() == _through_optuna(url, "real").to_dict()


def test_a_script_study_says_nothing_of_a_model_it_did_not_train(tmp_path):
    # Its trials ran the user's command: the workload's model (the default) is not what trained, so
    # neither its layers nor its hidden size may reach the notes and exports.
    url = f"sqlite:///{tmp_path}/db.sqlite"
    space = _space(tmp_path, "script", "  lora_rank: [8]\n")
    figures = {
        space.config_of(
            {"micro_batch": mb, "precision": "fp32", "checkpointing": False, "zero": "off", "lora": "8"}
        ): 100.0 * mb
        for mb in (2, 4, 8)
    }
    tune(
        study="script",
        workload=Workload(seq_len=32, global_batch=8),
        space=space,
        memory_budget_bytes=2**30,
        storage=url,
        backend=Scripted(figures),
        command=["python", "train.py"],
    )
    summary = load_summary(study="script", storage=url)
    assert summary.to_dict()["best"]["trains"]["note"] == "LoRA adapters only trained in fp32"
    peft = json.loads(export_config(summary.best.config, summary.workload, fmt="peft", device_type="cpu"))
    assert peft["target_modules"] is None and peft["r"] == 8  # PEFT's defaults for the script's own model
    zero = TrialConfig(micro_batch=2, zero_stage=2)
    hf = json.loads(export_config(zero, summary.workload, fmt="hf", device_type="cpu"))
    assert hf["deepspeed"]["zero_optimization"] == {"stage": 2, "reduce_bucket_size": "auto"}  # the Trainer sizes it
