import json

import pytest

from servebook import models
from servebook.errors import ParamsError


def test_tiny_model_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path / "a"))
    first = models.build_tiny_model()
    digests_a = json.loads((first / "servebook-build.json").read_text())["sha256"]
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert models.build_tiny_model() == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path / "b"))
    digests_b = json.loads((models.build_tiny_model() / "servebook-build.json").read_text())["sha256"]
    assert digests_a == digests_b

    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["vocab_size"] == 2048
    assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2 and config["head_dim"] == 32

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(first)
    text = "Serving a mixture of experts, 42 tokens."
    assert tok.decode(tok.encode(text)) == text  # byte-level: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_served_names_come_from_the_folder_and_an_unknown_builtin_is_refused_by_name():
    assert models.default_served_name("builtin:tiny-qwen3-moe") == "tiny-qwen3-moe"
    assert models.default_served_name("/data/models/Kimi-K2.5/") == "Kimi-K2.5"
    assert models.resolve("moonshotai/Kimi-K2.5") == "moonshotai/Kimi-K2.5"
    with pytest.raises(ParamsError, match="only builtin is builtin:tiny-qwen3-moe"):
        models.resolve("builtin:nope")
