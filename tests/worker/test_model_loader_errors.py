"""Bad model sources fail at load time with a ValueError that says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.loader import load_model
from tests.procs import worker
from tests.worker.test_model_hf_folder import save_tiny_checkpoint


def _load(source) -> None:
    load_model(str(source), torch.float32, torch.device("cpu"), TorchPagedAttention())


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory, smollm2_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("good")
    save_tiny_checkpoint(folder, "llama", smollm2_tokenizer)
    return folder


@pytest.fixture
def folder(good_folder, tmp_path) -> Path:
    """A fresh copy of a loadable checkpoint, for one test to break."""
    return Path(shutil.copytree(good_folder, tmp_path / "model"))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_unbroken_folder_loads(folder):
    _load(folder)


@pytest.mark.parametrize("source, message", [
    ("gpt-5", "unknown model source 'gpt-5'"),
    ("random:llama-9-1t", "unknown random model shape 'llama-9-1t'"),
    ("/no/such/model", "model path '/no/such/model' does not exist"),
    ("/no/such/model.gguf", "GGUF file '/no/such/model.gguf' does not exist"),
])
def test_unknown_or_missing_sources(source, message):
    with pytest.raises(ValueError, match=message):
        _load(source)


def test_corrupt_gguf_and_other_files(tmp_path, smollm2_gguf_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file.*unsupported GGUF version 0"):
        _load(tmp_path / "bad.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ValueError, match="bad magic"):
        _load(tmp_path / "text.gguf")
    with open(smollm2_gguf_path, "rb") as f:
        (tmp_path / "truncated.gguf").write_bytes(f.read(4_000_000))   # metadata whole, tensors cut
    with pytest.raises(ValueError, match="runs past the end of the file"):
        _load(tmp_path / "truncated.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="malformed GGUF file"):
        _load(tmp_path / "short.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="neither a .gguf file nor a checkpoint folder"):
        _load(tmp_path / "weights.bin")


@pytest.mark.parametrize("remove, message", [
    ("config.json", "lacks config.json"),
    ("tokenizer.json", "lacks tokenizer.json"),
    ("model.safetensors", "no \\*.safetensors weights"),
])
def test_missing_files(folder, remove, message):
    (folder / remove).unlink()
    with pytest.raises(ValueError, match=message):
        _load(folder)


@pytest.mark.parametrize("file, content, message", [
    ("config.json", "{not json", "corrupt config.json"),
    ("config.json", "[1, 2]", "corrupt config.json"),
    ("tokenizer.json", "{\"model\": 3}", "corrupt tokenizer.json"),
    ("model.safetensors", "garbage", "corrupt weights file"),
])
def test_corrupt_files(folder, file, content, message):
    (folder / file).write_text(content)
    with pytest.raises(ValueError, match=message):
        _load(folder)


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_size": None}, "config.json: lacks 'hidden_size'"),
    ({"hidden_size": 64.5}, "config.json: .*hidden_size must be a positive integer, got 64.5"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a positive number"),
    ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads"),
    ({"intermediate_size": 100}, "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
                                 "\\(64, 96\\), expected \\(64, 100\\) \\(from config.json\\)"),
    # transformers 5's rope_parameters, and 4.x's rope_scaling (which wins where both are given)
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "unsupported rope_scaling type 'mrope'"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}, "unsupported rope_scaling type 'mrope'"),
    ({"mlp_bias": True}, "config.json: mlp_bias = True is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling 'llama3' needs numbers"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling 'llama3' needs numbers"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0]}},
     "rope_scaling 'longrope' needs short_factor: a list of 8 numbers"),
    ({"rope_parameters": "big"}, "rope_parameters must be an object"),
    ({"sliding_window": 0, "model_type": "mistral"}, "sliding_window must be a positive integer, got 0"),
])
def test_bad_config_values(folder, changes, message):
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_missing_required_key(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: lacks 'num_hidden_layers'"):
        _load(folder)


def test_missing_and_unexpected_tensors(folder):
    tensors = {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}  # not mmapped: rewritten below
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model: checkpoint lacks 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"):
        _load(folder)
    save_file({**tensors, "model.layers.0.mystery.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        _load(folder)


def test_truncated_safetensors_names_the_file(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"corrupt weights file {weights}"):
        _load(folder)


def test_a_worker_given_a_bad_folder_exits_with_the_error_before_serving(folder, tmp_path):
    _edit_config(folder, model_type="gpt_oss")
    with pytest.raises(RuntimeError, match="(?s)process exited with [1-9].*config.json: model_type 'gpt_oss' "
                                           "is not supported \\(supported: llama, qwen2, qwen3"):
        with worker(tmp_path, model__source=str(folder), model__name="bad"):
            pass
