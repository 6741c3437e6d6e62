"""What a checkpoint is, from its ``config.json``: shapes, experts, attention kind, quantization, bytes.

Reads a local folder or a hub repository (``config.json`` and the safetensors index
only, never the weights).  Families it knows in detail: MiniMax-M2, DeepSeek-V3 and
Kimi-K2/K2.5 (MLA, the nested ``text_config``), Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5/4.6,
Llama-4, and dense Llama/Qwen.  Anything else gets a generic estimate, marked as such.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servebook.errors import ModelConfigError, ServebookError
from servebook.json_types import JsonObject

KNOWN_FAMILIES = {
    "minimax_m2": "MiniMax-M2",
    "deepseek_v3": "DeepSeek-V3",
    "deepseek_v2": "DeepSeek-V2",
    "kimi_k2": "Kimi-K2",
    "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral",
    "gpt_oss": "gpt-oss",
    "glm4_moe": "GLM-4.5",
    "llama4_text": "Llama-4",
    "llama4": "Llama-4",
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
}
MLA_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear", "glm_moe_dsa"}
# Model classes in vLLM that implement SupportsPP (vllm-parallelism.md section 3); unknown ones are assumed to.
NO_PP_TYPES: set[str] = set()


@dataclass
class Quantization:
    method: str = "none"  # none, fp8, int4, mxfp4, other
    block: tuple[int, int] | None = None  # FP8 weight_block_size [block_n, block_k]
    group_size: int | None = None  # INT4 group
    symmetric: bool = True
    actorder: str | None = None
    fmt: str = ""
    experts_only: bool = False  # attention and shared experts left in bf16
    raw: JsonObject = field(default_factory=dict)

    def weight_bytes_per_param(self, quantized: bool) -> float:
        if not quantized or self.method == "none":
            return 2.0
        if self.method == "fp8":
            bn, bk = self.block or (128, 128)
            return 1.0 + 4.0 / (bn * bk)  # fp32 scale per block
        if self.method == "int4":
            return 0.5 + 2.0 / (self.group_size or 128)  # bf16 scale per group
        if self.method == "mxfp4":
            return 0.5 + 1.0 / 32  # e8m0 scale per 32
        return 1.0


@dataclass
class ModelSpec:
    source: str
    model_type: str
    architecture: str
    family: str  # a known family, or "generic"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    dense_intermediate: int = 0  # MLP of dense layers (all layers of a dense model)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    shared_intermediate: int = 0  # total width of the shared expert MLP
    moe_layers: int = 0
    mla: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 0
    partial_rotary_factor: float = 1.0  # the share of head_dim RoPE turns (GLM-4.5: 0.5)
    quant: Quantization = field(default_factory=Quantization)
    checkpoint_bytes: int | None = None  # from the safetensors index, when present
    mtp_layers: int = 0  # next-token-prediction layers after the decoder's (num_nextn_predict_layers, num_mtp_modules)
    skipped_bytes: int | None = None  # of checkpoint_bytes, what vLLM's loader skips (the MTP layers); None: unknown
    supports_pp: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def loaded_bytes(self) -> int | None:
        """The checkpoint's bytes vLLM loads for serving: the files less the MTP layers it skips (they load only
        as a speculative-decoding draft model); None where the files' size, or the skipped part's, is unknown."""
        if self.checkpoint_bytes is None or (self.mtp_layers and self.skipped_bytes is None):
            return None
        return self.checkpoint_bytes - (self.skipped_bytes or 0)

    def skipped_by_vllm(self, tensor: str) -> bool:
        """Whether vLLM's loader drops this checkpoint tensor when serving the model: an MTP layer's (numbered
        after the decoder's layers, as ``get_spec_layer_idx_from_weight_name`` in vLLM's models/utils.py and
        MiniMax-M2's ``num_mtp_modules`` mapping read them), or one under ``mtp.`` (Qwen3-Next, Qwen3.5)."""
        if tensor.startswith("mtp."):
            return True
        for i in range(self.layers, self.layers + self.mtp_layers):
            if tensor.startswith((f"model.layers.{i}.", f"layers.{i}.", f"model.language_model.layers.{i}.")):
                return True
        return False

    @property
    def rotary_dim(self) -> int:
        """Dimensions per head that RoPE turns: MLA's rope part, else head_dim times the partial factor."""
        return self.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> JsonObject:
        return asdict(self)


def _need(cfg: JsonObject, name: str, source: str, *alts: str) -> Any:
    for key in (name, *alts):
        if cfg.get(key) is not None:
            return cfg[key]
    raise ModelConfigError(source, name)


def _quantization(q: JsonObject | None) -> Quantization:
    if not q:
        return Quantization()
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        return Quantization("fp8", tuple(block) if block else None, raw=q)
    if method == "mxfp4":
        return Quantization("mxfp4", experts_only=True, raw=q)
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        weights: JsonObject = (
            q.get("weights") or next((g.get("weights") for g in groups.values() if g.get("weights")), {}) or {}
        )
        ignore = " ".join(str(i) for i in (q.get("ignore") or q.get("ignore_patterns_reported") or []))
        experts_only = "attn" in ignore or "routed experts" in str(q.get("quantized_modules", ""))
        if weights.get("num_bits") == 4:
            return Quantization(
                "int4",
                group_size=weights.get("group_size"),
                symmetric=weights.get("symmetric", True),
                actorder=weights.get("actorder"),
                fmt=q.get("format", ""),
                experts_only=experts_only,
                raw=q,
            )
        if weights.get("num_bits") == 8 and weights.get("type") == "float":
            block = weights.get("block_structure")
            return Quantization("fp8", tuple(block) if block else None, experts_only=experts_only, raw=q)
    return Quantization("other", raw=q)


def from_config(config: JsonObject, source: str = "config.json", index: JsonObject | None = None) -> ModelSpec:
    """Describe a model from its config (and optionally its safetensors index)."""
    outer = config
    cfg = config.get("text_config") or config  # Kimi-K2.5, Llama-4: the language model is nested
    model_type = str(cfg.get("model_type") or outer.get("model_type") or "")
    arch = (cfg.get("architectures") or outer.get("architectures") or ["?"])[0]
    hidden = int(_need(cfg, "hidden_size", source))
    layers = int(_need(cfg, "num_hidden_layers", source))
    heads = int(_need(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(_need(cfg, "vocab_size", source))
    spec = ModelSpec(
        source=source,
        model_type=model_type,
        architecture=arch,
        family=KNOWN_FAMILIES.get(model_type, "generic"),
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or 1.0),
        quant=_quantization(cfg.get("quantization_config") or outer.get("quantization_config")),
        supports_pp=model_type not in NO_PP_TYPES,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_modules") or 0),
    )
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        spec.experts = int(experts)
        spec.experts_per_token = int(_need(cfg, "num_experts_per_tok", source))
        if model_type in ("minimax_m2", "mixtral", "gpt_oss"):
            spec.expert_intermediate = int(_need(cfg, "intermediate_size", source))  # per expert in these families
        elif model_type in ("llama4", "llama4_text"):
            spec.expert_intermediate = int(_need(cfg, "intermediate_size", source))
            spec.dense_intermediate = int(cfg.get("intermediate_size_mlp") or 0)
            spec.shared_experts, spec.shared_intermediate = 1, spec.expert_intermediate
        else:
            spec.expert_intermediate = int(_need(cfg, "moe_intermediate_size", source))
        if cfg.get("n_shared_experts"):
            spec.shared_experts = int(cfg["n_shared_experts"])
            spec.shared_intermediate = spec.expert_intermediate * spec.shared_experts
        elif cfg.get("shared_expert_intermediate_size"):
            spec.shared_experts, spec.shared_intermediate = 1, int(cfg["shared_expert_intermediate_size"])
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        if "moe_layer_freq" in cfg or "first_k_dense_replace" in cfg:  # DeepSeek style: layer % freq == 0
            freq = int(cfg.get("moe_layer_freq") or 1)
            is_moe = lambda i: i >= first_dense and i % freq == 0  # noqa: E731
        else:  # Qwen3-MoE, Llama-4: (layer + 1) % step == 0
            freq = int(cfg.get("decoder_sparse_step") or cfg.get("interleave_moe_layer_step") or 1)
            is_moe = lambda i: (i + 1) % freq == 0  # noqa: E731
        spec.moe_layers = sum(1 for i in range(layers) if is_moe(i) and i not in mlp_only)
        if spec.dense_layers and not spec.dense_intermediate:
            spec.dense_intermediate = int(cfg.get("intermediate_size") or 0)
    else:
        spec.dense_intermediate = int(_need(cfg, "intermediate_size", source))
    if model_type in MLA_TYPES and cfg.get("kv_lora_rank"):
        spec.mla = True
        spec.kv_lora_rank = int(cfg["kv_lora_rank"])
        spec.q_lora_rank = int(cfg.get("q_lora_rank") or 0)
        spec.qk_rope_head_dim = int(_need(cfg, "qk_rope_head_dim", source))
        spec.qk_nope_head_dim = int(_need(cfg, "qk_nope_head_dim", source))
        spec.v_head_dim = int(_need(cfg, "v_head_dim", source))
        spec.kv_heads = 1  # vLLM: get_num_kv_heads() is 1 under MLA
    if spec.family == "generic":
        spec.notes.append(
            f"architecture '{model_type or arch}' is not one servebook knows in detail: "
            "shapes read from standard fields, rules checked generically (an estimate)"
        )
    if index and index.get("metadata", {}).get("total_size"):
        spec.checkpoint_bytes = int(index["metadata"]["total_size"])
    _note_mtp(spec, index)
    return spec


def _note_mtp(spec: ModelSpec, index: JsonObject | None) -> None:
    if index and not spec.mtp_layers and any(name.startswith("mtp.") for name in index.get("weight_map", {})):
        spec.mtp_layers = 1  # an MTP module under its own prefix (Qwen3-Next): skipped, whatever its depth
    if spec.mtp_layers:
        spec.notes.append(
            f"the checkpoint carries {spec.mtp_layers} next-token-prediction (MTP) layer(s) that vLLM skips "
            "unless speculative decoding uses them as its draft model: the plan counts the weights vLLM loads"
        )


def _cached_config(model: str, revision: str | None) -> ModelSpec | None:
    """The model's config from the local hub cache, when HF_HUB_OFFLINE asks for nothing else."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json", revision=revision)
    if not isinstance(found, str):
        return None
    index = try_to_load_from_cache(model, "model.safetensors.index.json", revision=revision)
    return from_config(_read_json(Path(found)), model, _read_json(Path(index)) if isinstance(index, str) else None)


def _read_json(path: Path) -> JsonObject:
    """A JSON object from a checkpoint's file, or a ServebookError naming the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ServebookError(
            f"{path}: not readable JSON ({exc}); the file is cut or damaged: download the checkpoint again"
        ) from None
    if not isinstance(data, dict):
        raise ServebookError(f"{path}: holds a {type(data).__name__}, not a JSON object; download it again")
    return data


def load(model: str, revision: str | None = None) -> ModelSpec:
    """From a local folder, a config.json path, or a hub repository (config and index only)."""
    from servebook import models

    if models.is_builtin(model):
        model = models.resolve(model)
    path = Path(model).expanduser()
    if path.is_file():
        return from_config(_read_json(path), str(path))
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ServebookError(f"{path} has no config.json; point model at a checkpoint folder")
        index_path = path / "model.safetensors.index.json"
        spec = from_config(_read_json(config), str(path), _read_json(index_path) if index_path.is_file() else None)
        total, skipped = _safetensors_bytes(path, spec)
        if spec.checkpoint_bytes is None:
            spec.checkpoint_bytes = total
        if total:
            spec.skipped_bytes = skipped
        return spec
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from servebook import hub

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ServebookError(
            f"model '{model}' is no file or folder here ({path.resolve()}) and no hub repository id "
            "(namespace/name): check the path, or name the repository"
        ) from None
    cached = _cached_config(model, revision)
    if cached is not None and hub.offline():
        return cached
    hub.require(f"reading config.json of '{model}'")
    try:
        hub_config = _read_json(Path(hf_hub_download(model, "config.json", revision=revision)))
    except Exception as exc:
        raise ServebookError(
            f"could not read config.json of '{model}' from the hub ({type(exc).__name__}: {exc}); "
            "pass a local checkpoint folder or a config.json path"
        ) from None
    try:
        index = _read_json(Path(hf_hub_download(model, "model.safetensors.index.json", revision=revision)))
    except (EntryNotFoundError, Exception):
        index = None
    spec = from_config(hub_config, model, index)
    if spec.mtp_layers:
        spec.skipped_bytes = _hub_skipped_bytes(model, revision, spec)
    return spec


def _safetensors_bytes(folder: Path, spec: ModelSpec) -> tuple[int | None, int]:
    """Tensor bytes from the safetensors headers (no tensor data is read): all of them, and those vLLM skips."""
    import struct

    total = skipped = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            total += size
            skipped += size if spec.skipped_by_vllm(name) else 0
    return total or None, skipped


def _hub_skipped_bytes(model: str, revision: str | None, spec: ModelSpec) -> int | None:
    """The bytes of the hub checkpoint's tensors vLLM skips, from the shards' headers (a few kB each, no tensor
    data); None where they cannot be read (the plan then counts weights from the shapes alone)."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(model, revision=revision)
    except Exception:
        return None
    skipped = 0
    for file_meta in meta.files_metadata.values():
        for name, info in file_meta.tensors.items():
            if spec.skipped_by_vllm(name):
                skipped += info.data_offsets[1] - info.data_offsets[0]
    return skipped
