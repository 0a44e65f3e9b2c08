import json

import pytest

from autotune.config.workload import Workload
from autotune.errors import WorkloadError
from autotune.models.presets import PRESETS
from autotune.models.sources import (
    ModelSource,
    infer_task,
    load_hf_config,
    parse_model_source,
    resolve_task,
)


@pytest.mark.parametrize(
    "spec, kind",
    [
        ("builtin:gpt2-tiny", "builtin"),
        ("factories:tiny", "factory"),
        ("pkg.mod:make_model", "factory"),
        ("meta-llama/Llama-2-7b-hf", "hub"),
    ],
)
def test_parse_model_source(spec, kind):
    assert parse_model_source(spec).kind == kind


def test_a_path_is_a_config_source(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}))
    assert parse_model_source(str(tmp_path)) == ModelSource("config", str(tmp_path))
    config = load_hf_config(parse_model_source(str(tmp_path / "config.json")))
    assert config.model_type == "gpt2" and config.n_layer == 1


def test_every_preset_loads_with_its_task():
    for name, preset in PRESETS.items():
        config = load_hf_config(ModelSource("builtin", name))
        assert config.model_type == preset.model_type
        assert resolve_task(Workload(model=f"builtin:{name}")) == preset.task


def test_task_is_inferred_from_architectures(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    )
    assert resolve_task(Workload(model=str(tmp_path))) == "seq-cls"
    config = load_hf_config(ModelSource("builtin", "bert-tiny"))
    assert infer_task(config) == "seq-cls"
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "xlm-roberta", "architectures": ["XLMRobertaForMaskedLM"]})
    )
    assert resolve_task(Workload(model=str(tmp_path))) == "masked-lm"
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mt5", "architectures": ["MT5ForConditionalGeneration"]})
    )
    assert resolve_task(Workload(model=str(tmp_path))) == "seq2seq-lm"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart"}))  # no architectures: the config says
    assert resolve_task(Workload(model=str(tmp_path))) == "seq2seq-lm"
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "vit", "architectures": ["ViTForImageClassification"]})
    )
    assert resolve_task(Workload(model=str(tmp_path))) == "image-cls"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "convnext"}))  # pixels in, no vocabulary
    assert resolve_task(Workload(model=str(tmp_path))) == "image-cls"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("builtin:nope", "no such built-in model"),
        ("./missing/config.json", "is neither builtin:NAME"),
        ("not a model", "is neither builtin:NAME"),
    ],
)
def test_bad_sources_are_refused(spec, message):
    with pytest.raises(WorkloadError, match=message):
        parse_model_source(spec)


def test_an_unknown_builtin_gets_the_closest_names_not_the_list():
    with pytest.raises(WorkloadError) as refused:
        parse_model_source("builtin:lama-tiny")
    message = str(refused.value)
    assert "did you mean builtin:llama-tiny" in message and "`autotune models`" in message
    assert "builtin:resnet-50" not in message and len(message) < 200
    with pytest.raises(WorkloadError, match=r"no such built-in model; `autotune models` lists them all"):
        parse_model_source("builtin:zzz")  # nothing close: no guess


def test_uncached_hub_id_offline_says_what_to_do():
    with pytest.raises(WorkloadError, match=r"not in the local Hugging Face cache.*hf download"):
        resolve_task(Workload(model="no-such-org/no-such-model"))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(WorkloadError, match="no config.json"):
        resolve_task(Workload(model=str(tmp_path)))


# -- a config file is read as given ---------------------------------------------------------------
MINE = {
    "model_type": "gpt2",
    "n_layer": 3,
    "n_embd": 48,
    "n_head": 2,
    "n_positions": 256,
    "vocab_size": 300,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
DECOY = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 256, "vocab_size": 100}


def _decoy_beside(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DECOY))
    mine = tmp_path / "my-model.json"
    mine.write_text(json.dumps(MINE))
    return mine


def test_a_config_file_not_named_config_json_is_the_one_built(tmp_path):
    import torch

    from autotune.models.sources import build_model

    mine = _decoy_beside(tmp_path)
    config = load_hf_config(parse_model_source(str(mine)))
    assert (config.n_layer, config.n_embd, config.vocab_size) == (3, 48, 300)
    model = build_model(Workload(model=str(mine), seq_len=16), task="causal-lm", device=torch.device("meta"))
    assert len(model.transformer.h) == 3 and model.lm_head.weight.shape == (300, 48)


@pytest.mark.parametrize(
    "text, message",
    [
        ("hidden: 64\nlayers: 2\n", r"is not JSON \(line 1: Expecting value\)"),
        ("[1, 2, 3]", "is JSON but not a model config"),
    ],
)
def test_a_config_file_that_is_not_a_json_object_is_refused(tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=f"--model {path} {message}"):
        resolve_task(Workload(model=str(path)))


def test_a_binary_file_is_refused_as_not_json(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(WorkloadError, match=r"is not JSON \(not even text\)"):
        resolve_task(Workload(model=str(path)))


# Parameter counts of the published checkpoints (their model cards and config.json): the presets are
# these models' shapes, built on the meta device here, not downloaded.
PUBLISHED_PARAMS = {
    "t5-base": 222.9e6,
    "mt5-base": 582.4e6,
    "xlm-roberta-base": 278.3e6,
    "xlm-roberta-large": 560.1e6,
    "distilbert-base": 67.0e6,
    "vit-base": 86.6e6,
    "resnet-50": 25.6e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_a_real_shape_preset_has_its_models_published_size(name):
    import torch

    from autotune.models.sources import build_model

    model = build_model(Workload(model=f"builtin:{name}"), task=PRESETS[name].task, device=torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    expected = PUBLISHED_PARAMS[name]
    if name == "mt5-base" and model.config.tie_word_embeddings:  # Transformers 5 ties mT5's published untied head
        expected -= model.config.vocab_size * model.config.d_model
    assert params == pytest.approx(expected, rel=0.01), params
