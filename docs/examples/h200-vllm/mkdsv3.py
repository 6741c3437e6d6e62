"""A random-weight DeepSeek-V3-shaped checkpoint in block FP8, carrying its next-token-prediction (MTP) layer, built
where it will be served (issue #40's held-out MLA shape: no fit of servebook's reserve has seen MLA in FP8).

    python3 mkdsv3.py OUT --tokenizer TINY_MODEL_DIR [--shape deepseek-v3|kimi-k2] [--layers 2] [--mtp 1]
                      [--heads N] [--experts N] [--device cuda] [--tiny]

DeepSeek-V3's shapes per layer: hidden 7168, 128 heads, MLA (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128),
the first layer dense (intermediate 18432), the others MoE (256 routed experts of 2048, top-8, one shared expert,
sigmoid scoring with noaux_tc and 8 groups), vocabulary 129,280. Every linear layer but the router gate and the
head is block FP8 (float8_e4m3fn, float32 ``weight_scale_inv`` per 128 x 128 block, ceil at the edges, as
DeepSeek ships it: kv_a_proj_with_mqa's 576 rows have 5 row blocks); norms, embeddings, gate and head bf16.
The MTP layers follow the decoder's as ``model.layers.{L + i}``: a full MoE layer plus ``enorm``, ``hnorm``,
``eh_proj``, ``embed_tokens`` and ``shared_head`` (vLLM's DeepSeek loader skips them unless speculative decoding
uses them). One shard per layer plus one for the embeddings, head and final norm, and an index. ``--tiny``
shrinks every dimension (a CPU check of names against vLLM's loader).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from shards import BLOCK, Shards

DSV3 = dict(H=7168, NH=128, QL=1536, KVL=512, NOPE=128, ROPE=64, V=128, I=18432, MI=2048, E=256, K=8, NS=1,
            VOCAB=129280, GROUPS=8, TOPK_GROUPS=4)  # fmt: skip
# Kimi-K2's decoder in DeepSeek-V3's architecture and DeepSeek's block FP8 (issue #40: MLA in FP8 at 64 heads and
# 384 experts, which no fit has seen; the INT4 Kimi-K2.5 mini of the fit shares every shape but the quantization)
KIMI_K2 = dict(DSV3, NH=64, E=384, VOCAB=163840, GROUPS=1, TOPK_GROUPS=1)
# DeepSeek-V3 at Kimi-K2's 64 heads: the FP8-MLA pair above differs in heads, experts and vocabulary at once; this
# one moves the heads alone
DSV3_64_HEADS = dict(DSV3, NH=64)
# A DeepSeek-V3-architecture model at a quarter of its hidden size, Moonlight-like (hidden 2048, 16 heads, 64
# experts of 1,408, top-6, two shared, vocabulary 102,400): block-FP8 MLA at a hidden size and MoE shape the
# activation fit (hidden 7168, top-8 of 2,048) never saw
SMALL = dict(DSV3, H=2048, NH=16, I=11264, MI=1408, E=64, K=6, NS=2, VOCAB=102400, GROUPS=1, TOPK_GROUPS=1)
TINY = dict(H=256, NH=4, QL=128, KVL=512, NOPE=128, ROPE=64, V=128, I=512, MI=128, E=16, K=4, NS=1, VOCAB=4096,
            GROUPS=4, TOPK_GROUPS=2)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mtp", type=int, default=1, help="MTP layers after the decoder's (num_nextn_predict_layers)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=("deepseek-v3", "kimi-k2", "deepseek-v3-64h", "small"), default="deepseek-v3")
    ap.add_argument(
        "--heads", type=int, help="attention heads in place of the shape's (the FP8-MLA activation's heads)"
    )
    ap.add_argument("--experts", type=int, help="routed experts in place of the shape's (a smaller checkpoint)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write config.json alone (for the plan's tests)")
    a = ap.parse_args()
    t0 = time.time()
    d = TINY if a.tiny else {"kimi-k2": KIMI_K2, "deepseek-v3-64h": DSV3_64_HEADS, "small": SMALL}.get(a.shape, DSV3)
    d = dict(d, NH=a.heads or d["NH"], E=a.experts or d["E"])
    H, NH, QL, KVL, NOPE, ROPE, V = (d[k] for k in ("H", "NH", "QL", "KVL", "NOPE", "ROPE", "V"))
    I, MI, E, K, NS, VOCAB = (d[k] for k in ("I", "MI", "E", "K", "NS", "VOCAB"))  # noqa: E741
    L, dense = a.layers, 1
    out, tok = Path(a.out), Path(a.tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0,
        "first_k_dense_replace": dense, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": I, "kv_lora_rank": KVL, "max_position_embeddings": 163840, "moe_intermediate_size": MI,
        "moe_layer_freq": 1, "n_group": d["GROUPS"], "n_routed_experts": E, "n_shared_experts": NS,
        "norm_topk_prob": True, "num_attention_heads": NH, "num_experts_per_tok": K, "num_hidden_layers": L,
        "num_key_value_heads": NH, "num_nextn_predict_layers": a.mtp, "q_lora_rank": QL, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": d["TOPK_GROUPS"], "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
        "v_head_dim": V, "vocab_size": VOCAB,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [BLOCK, BLOCK]},
    }  # fmt: skip
    if a.config_only:
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return
    dev = a.device
    shards = Shards(out, dev, a.seed)
    rnd, ones, fp8 = shards.rnd, shards.ones, shards.fp8

    def layer(li: int, moe: bool) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        p = f"model.layers.{li}"
        sd[f"{p}.input_layernorm.weight"] = ones(H)
        sd[f"{p}.post_attention_layernorm.weight"] = ones(H)
        s = f"{p}.self_attn"
        fp8(sd, f"{s}.q_a_proj.weight", QL, H)
        sd[f"{s}.q_a_layernorm.weight"] = ones(QL)
        fp8(sd, f"{s}.q_b_proj.weight", NH * (NOPE + ROPE), QL)
        fp8(sd, f"{s}.kv_a_proj_with_mqa.weight", KVL + ROPE, H)
        sd[f"{s}.kv_a_layernorm.weight"] = ones(KVL)
        fp8(sd, f"{s}.kv_b_proj.weight", NH * (NOPE + V), KVL)
        fp8(sd, f"{s}.o_proj.weight", H, NH * V)
        m = f"{p}.mlp"
        if not moe:
            for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                fp8(sd, f"{m}.{proj}.weight", o, i)
            return sd
        sd[f"{m}.gate.weight"] = rnd(E, H)
        sd[f"{m}.gate.e_score_correction_bias"] = torch.zeros(E, dtype=torch.float32, device=dev)
        shared = MI * NS
        for proj, (o, i) in (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared))):
            fp8(sd, f"{m}.shared_experts.{proj}.weight", o, i)
        for proj, (o, i) in (("gate_proj", (MI, H)), ("up_proj", (MI, H)), ("down_proj", (H, MI))):
            for e in range(E):
                fp8(sd, f"{m}.experts.{e}.{proj}.weight", o, i)
        return sd

    total_layers = L + a.mtp
    files = [f"model-{n:05d}-of-{total_layers + 1:05d}.safetensors" for n in range(1, total_layers + 2)]
    write = shards.write

    for li in range(total_layers):
        sd = layer(li, moe=li >= dense)
        if li >= L:  # an MTP layer: its own embedding, projection of [embedding; hidden] and head
            p = f"model.layers.{li}"
            sd |= {f"{p}.enorm.weight": ones(H), f"{p}.hnorm.weight": ones(H), f"{p}.eh_proj.weight": rnd(H, 2 * H),
                   f"{p}.embed_tokens.weight": rnd(VOCAB, H), f"{p}.shared_head.norm.weight": ones(H),
                   f"{p}.shared_head.head.weight": rnd(VOCAB, H)}  # fmt: skip
        write(sd, files[li], is_mtp=li >= L)
        del sd
        print(f"  layer {li} written ({'MTP' if li >= L else 'MoE' if li >= dense else 'dense'}), "
              f"{time.time() - t0:.1f} s", flush=True)  # fmt: skip
    write({"model.embed_tokens.weight": rnd(VOCAB, H), "lm_head.weight": rnd(VOCAB, H), "model.norm.weight": ones(H)},
          files[total_layers])  # fmt: skip
    shards.finish(cfg, tok)
    print(f"{out}: {L} layers + {a.mtp} MTP, {'tiny' if a.tiny else 'DeepSeek-V3'} shapes, block FP8, "
          f"{shards.total / 1e9:.2f} GB tensors, of which MTP {shards.mtp_bytes / 1e9:.2f} GB, {time.time() - t0:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
