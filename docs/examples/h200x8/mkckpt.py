"""A random-weight Qwen3-MoE checkpoint in a real model's shapes, built where it will be served (no download).

    python3 mkckpt.py OUT --tokenizer TINY_MODEL_DIR --shape minimax-m2.5 [--layers 8] [--fp8] [--device cuda]

Shapes (``--shape``):

- ``qwen3-30b-a3b``: hidden 2048, 32 heads, 4 KV heads, 128 experts, top-8, expert intermediate 768 (the kit's
  ../shared/gpu/mkckpt.py, which this extends);
- ``minimax-m2.5``: MiniMax-M2.5's (../shared/fixtures/model-configs.json): hidden 3072, 48 heads, 8 KV heads of
  128, 256 experts, top-8, expert intermediate 1536, block FP8 128 x 128 with the router gate and lm_head left
  unquantized (its ``modules_to_not_convert``). The attention and expert shapes are what decide vLLM's layout
  rules and the memory per GPU (1536 / 8 = 192 is no multiple of 128: TP=8 without EP is refused); the
  architecture stays Qwen3-MoE, which vLLM serves with the same fused-MoE and block-FP8 kernels, so no
  MiniMax-specific weight names are guessed.

bf16 or FP8 block-quantized (float8_e4m3fn weights, float32 ``weight_scale_inv`` per 128 x 128 block); norms
and embeddings stay bf16. One shard per layer plus an index; the tokenizer (and vocabulary) from TINY_MODEL_DIR.
``--experts`` overrides the expert count, for a check of names and sizes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 128
SHAPES = {
    # hidden, heads, kv heads, head dim, experts, top-k, expert intermediate, quantized gate
    "qwen3-30b-a3b": dict(H=2048, NH=32, NKV=4, HD=128, E=128, K=8, I=768, gate_fp8=True),
    "minimax-m2.5": dict(H=3072, NH=48, NKV=8, HD=128, E=256, K=8, I=1536, gate_fp8=False),
    # Qwen3-235B-A22B's: a shape no fit of servebook's reserve has seen (issue #40's held-out GQA shape)
    "qwen3-235b-a22b": dict(H=4096, NH=64, NKV=4, HD=128, E=128, K=8, I=1536, gate_fp8=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--moe-inter", type=int, help="expert intermediate size (default: the shape's)")
    ap.add_argument("--experts", type=int, help="number of experts (default: the shape's)")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the tokenizer's; Qwen3's is 151936)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write config.json alone (for the plan's tests)")
    a = ap.parse_args()
    t0 = time.time()
    s = dict(SHAPES[a.shape])
    H, NH, NKV, HD, K = s["H"], s["NH"], s["NKV"], s["HD"], s["K"]
    E = a.experts or s["E"]
    I = a.moe_inter or s["I"]  # noqa: E741 (the config's own letter)
    tok = Path(a.tokenizer)
    vocab = a.vocab or json.loads((tok / "config.json").read_text())["vocab_size"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    L = a.layers
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0, "decoder_sparse_step": 1, "head_dim": HD,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 4 * H,
        "max_position_embeddings": 40960, "max_window_layers": L, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": I, "norm_topk_prob": True, "num_attention_heads": NH, "num_experts": E,
        "num_experts_per_tok": K, "num_hidden_layers": L, "num_key_value_heads": NKV, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab,
    }  # fmt: skip
    if a.fp8:
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
        }  # fmt: skip
        if not s["gate_fp8"]:
            # vLLM's Fp8Config reads modules_to_not_convert as its ignored layers, matched by full prefix
            cfg["quantization_config"]["modules_to_not_convert"] = [f"model.layers.{i}.mlp.gate" for i in range(L)]
    if a.config_only:
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return
    dev = a.device
    g = torch.Generator(device=dev).manual_seed(a.seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * std).to(torch.bfloat16)

    def quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., out, in] bf16 -> fp8 weight and float32 scale_inv [..., ceil(out/128), ceil(in/128)]."""
        *lead, o, i = w.shape
        bo, bi = math.ceil(o / BLOCK), math.ceil(i / BLOCK)
        pad = torch.zeros(*lead, bo * BLOCK, bi * BLOCK, device=dev, dtype=torch.float32)
        pad[..., :o, :i] = w.float()
        blocks = pad.view(*lead, bo, BLOCK, bi, BLOCK)
        scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).view(*lead, bo * BLOCK, bi * BLOCK)
        return q[..., :o, :i].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()

    def put(sd: dict[str, torch.Tensor], name: str, w: torch.Tensor, quantize: bool) -> None:
        if quantize and a.fp8:
            q, scale = quant(w)
            sd[name] = q
            sd[name.replace(".weight", ".weight_scale_inv")] = scale
        else:
            sd[name] = w

    def to_cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in sd.items()}

    files = [f"model-{n:05d}-of-{L + 1:05d}.safetensors" for n in range(1, L + 2)]
    weight_map, total = {}, 0
    for li in range(L):
        sd: dict[str, torch.Tensor] = {}
        p = f"model.layers.{li}"
        sd[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16, device=dev)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16, device=dev)
        put(sd, f"{p}.self_attn.q_proj.weight", rnd(NH * HD, H), True)
        put(sd, f"{p}.self_attn.k_proj.weight", rnd(NKV * HD, H), True)
        put(sd, f"{p}.self_attn.v_proj.weight", rnd(NKV * HD, H), True)
        put(sd, f"{p}.self_attn.o_proj.weight", rnd(H, NH * HD), True)
        sd[f"{p}.self_attn.q_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16, device=dev)
        sd[f"{p}.self_attn.k_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16, device=dev)
        put(sd, f"{p}.mlp.gate.weight", rnd(E, H), s["gate_fp8"])
        for proj, shape in (("gate_proj", (E, I, H)), ("up_proj", (E, I, H)), ("down_proj", (E, H, I))):
            for e in range(E):  # one expert at a time: 256 experts of MiniMax's size do not fit a CPU's memory at once
                put(sd, f"{p}.mlp.experts.{e}.{proj}.weight", rnd(*shape[1:]), True)
        sd = to_cpu(sd)
        save_file(sd, str(out / files[li]), metadata={"format": "pt"})
        for k, v in sd.items():
            weight_map[k] = files[li]
            total += v.numel() * v.element_size()
        del sd
    sd = to_cpu(
        {
            "model.embed_tokens.weight": rnd(vocab, H),
            "lm_head.weight": rnd(vocab, H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16, device=dev),
        }
    )
    save_file(sd, str(out / files[L]), metadata={"format": "pt"})
    for k, v in sd.items():
        weight_map[k] = files[L]
        total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / f).is_file():
            shutil.copy(tok / f, out / f)
    print(
        f"{out}: {a.shape}, {L} layers, {E} experts, expert intermediate {I}, {'fp8 block' if a.fp8 else 'bf16'}, "
        f"{total / 1e9:.2f} GB tensors, {len(weight_map)} tensors, {time.time() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
