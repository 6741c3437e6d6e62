"""A random-weight GLM-4.5-shaped checkpoint in block FP8, carrying its next-token-prediction (MTP) layer, built
where it will be served (issue #40: a GQA shape no fit of servebook's reserve has seen, with biased projections,
half-rotary heads, a 151,552-token vocabulary and an MTP layer vLLM skips).

    python3 mkglm.py OUT --tokenizer TINY_MODEL_DIR [--layers 2] [--mtp 1] [--device cuda] [--tiny] [--bf16]

GLM-4.5's shapes per layer (Glm4MoeForCausalLM): hidden 5120, 96 query heads and 8 KV heads of 128 with biased
q/k/v projections and rotary on half of each head, the first layer dense (intermediate 12288; GLM-4.5 has three),
the others MoE (160 routed experts of 1536, top-8, one shared expert, sigmoid scoring with a correction bias),
vocabulary 151,552. Every linear layer but the router gate and the head is block FP8 (float8_e4m3fn, float32
``weight_scale_inv`` per 128 x 128 block); biases, norms, embeddings, gate and head bf16. The MTP layers follow the
decoder's as ``model.layers.{L + i}``: a MoE layer plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``
(vLLM's GLM-4.5 loader skips them: ``skip_spec_layers``). One shard per layer plus one for the embeddings, head and
final norm, and an index. ``--tiny --bf16`` shrinks every dimension and leaves the weights in bf16: a CPU check of
the names against vLLM's loader.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from shards import BLOCK, Shards

GLM45 = dict(H=5120, NH=96, NKV=8, HD=128, I=12288, MI=1536, E=160, K=8, NS=1, VOCAB=151552)
# GLM-4.5-Air (zai-org/GLM-4.5-Air's config.json): the same architecture narrower, one dense layer of 10,944. In
# block FP8 that width is 85.5 blocks, and vLLM 0.25 cannot load the merged gate_up it makes (on the H100,
# 2026-12-06: "start (86) + length (86) exceeds dimension size (171)"), so the mini's dense layer is 86 blocks wide
AIR = dict(H=4096, NH=96, NKV=8, HD=128, I=11008, MI=1408, E=128, K=8, NS=1, VOCAB=151552)
TINY = dict(H=256, NH=4, NKV=2, HD=64, I=512, MI=128, E=16, K=4, NS=1, VOCAB=4096)


def config(d: dict[str, int], layers: int, mtp: int, fp8: bool) -> dict[str, object]:
    cfg: dict[str, object] = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 2, "pad_token_id": 0, "first_k_dense_replace": 1,
        "head_dim": d["HD"], "hidden_act": "silu", "hidden_size": d["H"], "initializer_range": 0.02,
        "intermediate_size": d["I"], "max_position_embeddings": 131072, "moe_intermediate_size": d["MI"],
        "n_group": 1, "n_routed_experts": d["E"], "n_shared_experts": d["NS"], "norm_topk_prob": True,
        "num_attention_heads": d["NH"], "num_experts_per_tok": d["K"], "num_hidden_layers": layers,
        "num_key_value_heads": d["NKV"], "num_nextn_predict_layers": mtp, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "use_cache": True,
        "use_qk_norm": False, "vocab_size": d["VOCAB"],
    }  # fmt: skip
    if fp8:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mtp", type=int, default=1, help="MTP layers after the decoder's (num_nextn_predict_layers)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", choices=("glm-4.5", "glm-4.5-air"), default="glm-4.5")
    ap.add_argument("--bf16", action="store_true", help="leave every weight in bf16 (a CPU build serves no FP8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write config.json alone (for the plan's tests)")
    a = ap.parse_args()
    t0 = time.time()
    d = TINY if a.tiny else AIR if a.shape == "glm-4.5-air" else GLM45
    H, NH, NKV, HD, I, MI, E, NS, VOCAB = (d[k] for k in ("H", "NH", "NKV", "HD", "I", "MI", "E", "NS", "VOCAB"))  # noqa: E741
    L, dense, fp8 = a.layers, 1, not a.bf16
    out, tok = Path(a.out), Path(a.tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(d, L, a.mtp, fp8)
    if a.config_only:
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return
    dev = a.device
    shards = Shards(out, dev, a.seed)
    rnd, ones = shards.rnd, shards.ones

    def linear(sd: dict[str, torch.Tensor], name: str, o: int, i: int) -> None:
        """A linear [o, i]: block FP8 (random codes of a weight's spread, one scale per 128 x 128 block) or bf16."""
        if fp8:
            shards.fp8(sd, name, o, i)
        else:
            sd[name] = rnd(o, i)

    def mlp(sd: dict[str, torch.Tensor], prefix: str, inter: int) -> None:
        for proj, (o, i) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            linear(sd, f"{prefix}.{proj}.weight", o, i)

    def layer(li: int, moe: bool) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        p = f"model.layers.{li}"
        sd[f"{p}.input_layernorm.weight"] = ones(H)
        sd[f"{p}.post_attention_layernorm.weight"] = ones(H)
        s = f"{p}.self_attn"
        for proj, heads in (("q_proj", NH), ("k_proj", NKV), ("v_proj", NKV)):
            linear(sd, f"{s}.{proj}.weight", heads * HD, H)
            sd[f"{s}.{proj}.bias"] = rnd(heads * HD)
        linear(sd, f"{s}.o_proj.weight", H, NH * HD)
        if not moe:
            mlp(sd, f"{p}.mlp", I)
            return sd
        sd[f"{p}.mlp.gate.weight"] = rnd(E, H)
        sd[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(E, dtype=torch.float32, device=dev)
        mlp(sd, f"{p}.mlp.shared_experts", MI * NS)
        for e in range(E):
            mlp(sd, f"{p}.mlp.experts.{e}", MI)
        return sd

    total_layers = L + a.mtp
    files = [f"model-{n:05d}-of-{total_layers + 1:05d}.safetensors" for n in range(1, total_layers + 2)]
    write = shards.write

    for li in range(total_layers):
        sd = layer(li, moe=li >= dense)
        if li >= L:  # an MTP layer: projection of [embedding; hidden], its norms and head
            p = f"model.layers.{li}"
            sd |= {f"{p}.enorm.weight": ones(H), f"{p}.hnorm.weight": ones(H), f"{p}.eh_proj.weight": rnd(H, 2 * H),
                   f"{p}.shared_head.norm.weight": ones(H), f"{p}.shared_head.head.weight": rnd(VOCAB, H)}  # fmt: skip
        write(sd, files[li], is_mtp=li >= L)
        del sd
        print(f"  layer {li} written ({'MTP' if li >= L else 'MoE' if li >= dense else 'dense'}), "
              f"{time.time() - t0:.1f} s", flush=True)  # fmt: skip
    write({"model.embed_tokens.weight": rnd(VOCAB, H), "lm_head.weight": rnd(VOCAB, H), "model.norm.weight": ones(H)},
          files[total_layers])  # fmt: skip
    shards.finish(cfg, tok)
    print(f"{out}: {L} layers + {a.mtp} MTP, {'tiny' if a.tiny else a.shape} shapes, "
          f"{'block FP8' if fp8 else 'bf16'}, {shards.total / 1e9:.2f} GB tensors, of which MTP {shards.mtp_bytes / 1e9:.2f} GB, "
          f"{time.time() - t0:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
