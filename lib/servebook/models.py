"""Where a model comes from: a local folder, a hub repository, or the embedded tiny MoE.

``builtin:tiny-qwen3-moe`` is a Qwen3-MoE checkpoint with random weights and a
byte-level BPE tokenizer trained here, built deterministically in seconds and
cached, so the whole pipeline runs real vLLM on a machine without GPUs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from servebook.errors import ParamsError

BUILTIN_PREFIX = "builtin:"
TINY_NAME = "tiny-qwen3-moe"
# Bump when anything below changes what gets built; the cache key follows it.
TINY_VERSION = 1

TINY_CONFIG = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to in on for with by from at as is are was be been serve serving server model models token tokens "
    "expert experts mixture parallel tensor pipeline data memory cache kv gpu gpus node nodes bandwidth latency "
    "throughput batch request requests stream streams first time per output input prompt length context load loading "
    "weight weights shard shards quantized fp8 int4 block size hidden layer layers attention head heads route router "
    "benchmark sweep plateau concurrency user users second seconds minute minutes report notebook run runs stage "
    "launch smoke test deploy service unit restart health ready wait stop clean process processes leftover orphan "
    "nccl all reduce gather ring tree protocol channel link nvlink pcie topology switch socket host device driver"
).split()


def cache_root() -> Path:
    return Path(os.environ.get("SERVEBOOK_CACHE", Path.home() / ".cache" / "servebook")).expanduser()


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def tiny_model_dir() -> Path:
    return cache_root() / "models" / f"{TINY_NAME}-v{TINY_VERSION}"


def _corpus(n_sentences: int = 4000) -> list[str]:
    rng = random.Random(0)
    lines = []
    for i in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        words[0] = words[0].capitalize()
        lines.append(f"{' '.join(words)} {i % 97}, {rng.randint(0, 9999)}.")
    return lines


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_weights(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    values: dict[str, Any] = dict(TINY_CONFIG)
    config = Qwen3MoeConfig(
        **values,
        torch_dtype="bfloat16",
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id).save_pretrained(out)


def build_tiny_model(force: bool = False) -> Path:
    """Build (or reuse) the embedded tiny MoE checkpoint; returns its folder."""
    target = tiny_model_dir()
    if (target / "servebook-build.json").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=target.parent))
    try:
        _train_tokenizer(work)
        _build_weights(work)
        digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(work.iterdir()) if p.is_file()}
        (work / "servebook-build.json").write_text(
            json.dumps({"name": TINY_NAME, "version": TINY_VERSION, "sha256": digests}, indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def resolve(model: str) -> str:
    """A path or repo id vLLM can load; builds the embedded model when named."""
    if is_builtin(model):
        name = model[len(BUILTIN_PREFIX) :]
        if name != TINY_NAME:
            raise ParamsError("model", [f"unknown builtin '{name}'; the only builtin is {BUILTIN_PREFIX}{TINY_NAME}"])
        return str(build_tiny_model())
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def default_served_name(model: str) -> str:
    if is_builtin(model):
        return model[len(BUILTIN_PREFIX) :]
    return Path(model.rstrip("/")).name or model


def local_checkpoint_bytes(path: str | Path) -> int:
    """Bytes of weight files in a local checkpoint folder."""
    path = Path(path)
    files = [p for p in path.glob("*") if p.suffix in {".safetensors", ".bin", ".pt", ".gguf"}]
    return sum(p.stat().st_size for p in files)


def hub_checkpoint_bytes(repo_id: str, timeout_s: float = 10.0) -> int | None:
    """Weight bytes of a hub repository from its metadata, or None when the hub cannot be asked."""
    from huggingface_hub import HfApi

    from servebook import hub
    from servebook.errors import HubUnreachable

    try:
        hub.require("checkpoint size")
        info = HfApi().model_info(repo_id, files_metadata=True, timeout=timeout_s)
    except HubUnreachable:
        return None
    except Exception:  # offline, gated, unknown: the caller reports "unknown"
        return None
    sizes = [s.size or 0 for s in info.siblings or [] if s.rfilename.endswith(".safetensors")]
    return sum(sizes) or None


def checkpoint_bytes(model: str, fallback_gb: float = 0.0) -> tuple[int | None, bool]:
    """(bytes of weights, already on local disk)."""
    if is_builtin(model):
        path = tiny_model_dir()
        return (local_checkpoint_bytes(path) if path.exists() else 3 * 1024**2), True
    path = Path(model).expanduser()
    if path.is_dir():
        return local_checkpoint_bytes(path), True
    size = hub_checkpoint_bytes(model)
    if size is None and fallback_gb:
        size = int(fallback_gb * 1e9)
    return size, False
