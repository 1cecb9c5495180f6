"""What `init_from=hf:` checks before it builds anything, from config.json and the safetensors
headers alone (model/hf `check_hf_weights`, `HFWeights.headers`, config_values): every family's
own export passes; a config.json whose head count is not the weights' is refused naming the
file, the tensor and both shapes; a value of the wrong type names its key; a truncated file and
a shard index naming a file outside its directory are refused naming the file."""

from __future__ import annotations

import json

import pytest

from model.errors import ConfigError
from model.hf import HFWeights, config_from_hf, save_hf
from model.hf.config_values import check_value_types
from model.hf.family import family_for_hf
from model.hf.mtp_layers import without_missing
from model.hf.weights_check import check_hf_weights
from tests.model.hf_helpers import perturbed
from tests.model.test_hf_parts import CASES


def _imported(directory):
    hf = json.loads((directory / "config.json").read_text())
    weights = HFWeights(directory)
    return weights, without_missing(config_from_hf(hf), weights.names()), family_for_hf(hf)


@pytest.mark.parametrize("name", list(CASES))
def test_every_familys_export_passes_the_check(name, tmp_path):
    save_hf(perturbed(CASES[name]), tmp_path / "hf")
    check_hf_weights(*_imported(tmp_path / "hf"))


def test_a_head_count_that_is_not_the_weights_is_named_with_both_shapes(tmp_path):
    tmp_path = save_hf(perturbed(CASES["llama/gqa_untied"]), tmp_path / "hf")
    config = json.loads((tmp_path / "config.json").read_text())
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    config["num_attention_heads"] = 2 * heads
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows, d_model = heads * head_dim, config["hidden_size"]
    with pytest.raises(ConfigError) as err:
        check_hf_weights(*_imported(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message and "q_proj" in message
    assert f"({rows}, {d_model})" in message and f"({2 * rows}, {d_model})" in message


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("num_hidden_layers", "two", "a whole number"),
        ("rms_norm_eps", [1e-6], "a number"),
        ("tie_word_embeddings", "yes", "true or false"),
        ("rope_scaling", "linear", "a JSON object"),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(key, value, rule):
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, key: value}
    with pytest.raises(ConfigError, match=f"{key}=.* is not {rule}"):
        check_value_types(config)


def test_a_truncated_file_is_named(tmp_path):
    path = save_hf(perturbed(CASES["llama/gqa_untied"]), tmp_path / "hf") / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{path} cannot be read"):
        HFWeights(path.parent)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/outside.safetensors"])
def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, target):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": target}})
    )
    with pytest.raises(ValueError, match="lies outside its directory"):
        HFWeights(tmp_path)
