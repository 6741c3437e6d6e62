"""What mkdsv3.py and mkglm.py share: random tensors from one seeded generator, block-FP8 linears, one safetensors
shard per layer (counting the MTP layers' bytes apart), and the index, config and tokenizer files beside them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 128


class Shards:
    def __init__(self, out: Path, device: str, seed: int) -> None:
        self.out, self.dev = out, device
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.weight_map: dict[str, str] = {}
        self.total = self.mtp_bytes = 0

    def rnd(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.dev, dtype=torch.float32) * std).to(torch.bfloat16)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16, device=self.dev)

    def fp8(self, sd: dict[str, torch.Tensor], name: str, o: int, i: int) -> None:
        """A linear [o, i] as block FP8: random codes of a weight's spread, one scale per 128 x 128 block."""
        w = torch.randn(o, i, generator=self.g, device=self.dev, dtype=torch.float32).clamp(-4, 4) * 100
        sd[name] = w.to(torch.float8_e4m3fn)
        sd[name.replace(".weight", ".weight_scale_inv")] = torch.full(
            (math.ceil(o / BLOCK), math.ceil(i / BLOCK)), 2e-4, dtype=torch.float32, device=self.dev
        )

    def write(self, sd: dict[str, torch.Tensor], fname: str, is_mtp: bool = False) -> None:
        sd = {k: v.contiguous().cpu() for k, v in sd.items()}
        save_file(sd, str(self.out / fname), metadata={"format": "pt"})
        size = sum(v.numel() * v.element_size() for v in sd.values())
        self.total += size
        self.mtp_bytes += size if is_mtp else 0
        self.weight_map.update({k: fname for k in sd})

    def finish(self, cfg: dict[str, object], tokenizer: Path) -> None:
        """The index, config and generation config, and the tokenizer's files where it has them."""
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2))
        (self.out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer / f).is_file():
                shutil.copy(tokenizer / f, self.out / f)
