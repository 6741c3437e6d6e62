"""How sure the plan is, and what it learned: an error band on every predicted figure, from where each term comes
from, and a local history of what vLLM reported at every launch and rehearsal, which a later plan of the same
model signature on the same GPU and vLLM version starts from.

Where a figure comes from (its *provenance*):

- **measured**: the history holds a launch or rehearsal of the same signature on the same GPU and vLLM version;
  the plan moves its KV memory by what that start's KV missed by (bytes), and the band is that of a relaunch.
- **calibrated**: the reserve's terms were fitted on this attention kind and quantization (GQA in BF16 and block
  FP8, MLA with INT4 experts and in block FP8; vLLM 0.25 on H200 and H100, docs/examples/h200-vllm).
- **extrapolated**: anything else (another attention kind or quantization, or a GPU with no fit).

A band is one-sided relative half-width: the figure is ``value x (1 +- band)``. The KV band is what the weights'
and each reserve term's bands leave of the KV memory, added up (the terms' errors are not independent: the
worst case is the honest one)."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from servebook import files
from servebook.modelspec import ModelSpec

if TYPE_CHECKING:
    from servebook.planner.layout import Layout

Provenance = Literal["measured", "calibrated", "extrapolated"]

# (attention kind, quantization) the reserve's terms were fitted on, and the GPU those fits ran on
CALIBRATED_KINDS = {("gqa", "none"), ("gqa", "fp8"), ("mla", "int4"), ("mla", "fp8")}
CALIBRATED_GPUS = ("H200", "H100")  # the same Hopper kernels and graph sizes
# One side's relative uncertainty of each term, by provenance: weights within 1.1 % of what vLLM logs on every
# committed log (the 2-layer, 2,048-hidden block-FP8 MLA mini of run-truth-small is 16 MiB short; under GQA see
# GQA_CALIBRATED_WEIGHTS_BAND); each reserve term checked against every term vLLM logged at DEBUG
# (docs/examples/h200-vllm/run-truth-h100: three never-fitted block-FP8 shapes at three settings): the activation
# peak missed by up to 12 % where calibrated (the GLM-4.5 mini at vLLM's defaults) and by up to 43 % where
# extrapolated (FP8 MLA at 128 requests: the plan's 5.27 GiB against vLLM's 2.99, both minis).
TERM_BANDS: dict[Provenance, dict[str, float]] = {
    "measured": {"weights": 0.005, "activation": 0.01, "cuda_graphs": 0.02, "non_torch": 0.05},
    "calibrated": {"weights": 0.012, "activation": 0.15, "cuda_graphs": 0.20, "non_torch": 0.25},
    "extrapolated": {"weights": 0.02, "activation": 0.50, "cuda_graphs": 0.50, "non_torch": 0.50},
}
# The CUDA-graph estimate's two parts (sizing.graph_estimate): the first capture, from vLLM's own rule per request,
# head and value dimension (within 3.5 % of every FULL first capture logged, 7 % of block-FP8 MLA's PIECEWISE
# ones), and what each further PIECEWISE graph takes (a further FULL graph took vLLM's 1 MiB floor on all 54 logs
# that say): the floor, or under GQA, where the attention output reaches 10 MiB, the 2 MiB most such second
# captures took (sizing.GRAPH_LARGE_OUTPUT_PER_GRAPH_BYTES). Four GLM-4.5-shaped minis at the same 96 heads took 1,
# 2, 2 and 12 MiB (run-truth-h100, run-truth-air, run-profile-peak), and the INT4 Kimi mini 2: how the first capture
# packed decides, so a further PIECEWISE graph keeps a spread of 11 MiB. Block-FP8 MLA has none: all 38 modes
# logged by its 19 starts (run-truth-h100, run-truth-heads) took 1.00 MiB per graph.
GRAPH_FIRST_CAPTURE_BAND = 0.07
GRAPH_PER_GRAPH_SPREAD_BYTES = 11 * 2**20
GRAPH_PER_GRAPH_SPREAD_MEASURED = {("mla", "fp8"): 0.0}  # (attention kind, quantization): the spread seen
# What no term models, bytes per GPU: the CUDA context NVML counts and CUDA does not on a card never measured
# (sizing.CUDA_HIDDEN_BYTES_BY_GPU holds the H100's 0.47 GiB, from the total_memory vLLM's worker logs; the H200's
# 0.60 is the default) and vLLM's block rounding. Before the terms had bands that held vLLM's figures (the sampler unmodelled, the graph
# rule fitted per model), this stood in for them at 1.75 GiB (calibrated) and 2.5 GiB (extrapolated).
UNMODELLED_BYTES: dict[Provenance, float] = {
    "measured": 1.0 * 2**30,
    "calibrated": 0.5 * 2**30,
    "extrapolated": 0.5 * 2**30,
}
# a relaunch of the very command (same layout and settings) lands within vLLM's own run-to-run spread
SAME_COMMAND_KV_BAND = 0.003
# what a start at other settings teaches: the gap it measured, less sure by half of what the terms moved since
# (the Kimi-shaped mini's rehearsals: moving from 1,024 to 32 sequences moved its KV 0.46 % beyond the plan's change)
MOVED_TERMS_SHARE = 0.5
# a start at other settings is learned from only where it narrows the band by a quarter: on the held-out H200
# starts a gap learned at vLLM's defaults moved the figure at max_num_seqs 128 from -0.05 % to -1.01 %
LEARN_WHEN_BAND_SHRINKS_TO = 0.75
SAME_GRAPHS_SHARE = 0.01  # a CUDA-graph estimate the plan moves by less than this is the one measured
CPU_KV_BAND = 0.005  # a fixed KV space (VLLM_CPU_KVCACHE_SPACE): only the block rounding moves it


def attention_kind(spec: ModelSpec) -> str:
    return "mla" if spec.mla else "gqa"


def signature(spec: ModelSpec) -> str:
    """What the reserve depends on in a model, as one key: architecture, attention kind, quantization, hidden
    size, vocabulary, layers and experts."""
    quant = spec.quant.method + (f"-{spec.quant.block[0]}x{spec.quant.block[1]}" if spec.quant.block else "")
    return (
        f"{spec.model_type or spec.architecture}/{attention_kind(spec)}/{quant}/h{spec.hidden}/v{spec.vocab}"
        f"/L{spec.layers}/E{spec.experts}"
    )


def provenance(spec: ModelSpec, gpu_name: str) -> Provenance:
    """Calibrated where the reserve was fitted on this attention kind and quantization on such a GPU."""
    fitted = (attention_kind(spec), spec.quant.method) in CALIBRATED_KINDS
    return "calibrated" if fitted and any(g in gpu_name.upper() for g in CALIBRATED_GPUS) else "extrapolated"


class Band(BaseModel):
    """A predicted figure with its band and where it comes from."""

    value: float
    band: float  # relative half-width: value x (1 +- band)
    provenance: Provenance
    basis: str = ""

    @property
    def low(self) -> float:
        return self.value * (1 - self.band)

    @property
    def high(self) -> float:
        return self.value * (1 + self.band)

    def contains(self, observed: float) -> bool:
        return self.low <= observed <= self.high

    def text(self, unit: str = "", digits: int = 0) -> str:
        return f"{self.value:,.{digits}f}{unit} ± {100 * self.band:.1f} % ({self.provenance})"


# ---------------------------------------------------------------- the history


class Measured(BaseModel):
    """One start's figures, as the plan predicted them and as vLLM reported them."""

    at: str
    source: Literal["launch", "rehearsal", "benchmark"]
    signature: str
    gpu: str
    vllm: str  # major.minor
    layout: str
    settings: dict[str, str]  # what moves the reserve besides the layout, as text (max_num_seqs, batched tokens…)
    kv_bytes_per_token: float  # per GPU, exact from the shapes
    predicted_kv_tokens: int
    kv_cache_tokens: int
    predicted_terms: dict[str, float] = {}  # the reserve's terms as the plan predicted them then, bytes
    predicted_weight_gib: float = 0.0
    weight_gib: float | None = None
    throughput: dict[str, float] = {}  # concurrency -> output tok/s measured
    workload: str = ""  # what the throughput was measured with (workload_key), '' where none was
    graph_gib: float | None = None  # vLLM's CUDA-graph estimate as logged ("Estimated CUDA graph memory")
    # a rehearsal runs on dummy weights: what a first start on real weights keeps beyond it, as planned (bytes)
    real_first_start: float = 0.0

    @property
    def kv_gap_bytes(self) -> float:
        """What the plan's KV memory missed a real start's by, in bytes (positive: vLLM had more). A dummy-weight
        start counts as the real start it rehearsed: less what a real first start keeps beyond it."""
        return (self.kv_cache_tokens - self.predicted_kv_tokens) * self.kv_bytes_per_token - self.real_first_start

    def gap_parts(self) -> dict[str, float]:
        """The KV gap split by vLLM's own terms where its log gave them, in bytes of reserve vLLM did *not* use
        beyond the plan: weights ("Model loading took"), CUDA graphs ("Estimated CUDA graph memory"), and the rest
        (activation peak, non-torch, memory CUDA does not report), which the log gives only as what is left."""
        weights = (self.predicted_weight_gib - self.weight_gib) * 2**30 if self.weight_gib else 0.0
        planned_graphs = self.predicted_terms.get("cuda_graphs", 0.0)
        graphs = planned_graphs - self.graph_gib * 2**30 if self.graph_gib is not None and planned_graphs else 0.0
        return {"weights": weights, "cuda_graphs": graphs, "rest": self.kv_gap_bytes - weights - graphs}

    @property
    def compiled_cold(self) -> bool:
        """The start compiled cold (the plan it was learned against expected a torch.compile cache miss)."""
        return self.settings.get("compile_cache_hit") == "False" and self.settings.get("enforce_eager") != "True"

    def same_graphs(self, terms: dict[str, float]) -> bool:
        """Whether a plan with these reserve terms captures the graphs this start captured, and vLLM logged their
        estimate: its figure is then a measurement, whatever else the settings moved."""
        planned = self.predicted_terms.get("cuda_graphs", 0.0)
        return (
            self.graph_gib is not None and planned > 0
            and abs(terms.get("cuda_graphs", 0.0) - planned) <= SAME_GRAPHS_SHARE * planned
        )  # fmt: skip

    def gap_for(self, weights: float, terms: dict[str, float]) -> float:
        """What this start teaches a plan of the same signature with these weights and reserve terms (bytes per
        GPU): the weights' miss in proportion to the weights (a share of the same tensors), the CUDA graphs' miss
        only where the plan captures the same graphs (vLLM measures its estimate by capturing the largest two of
        each mode: at other capture sizes the miss is not known, and scaling it was wrong by 11 GiB on the
        DeepSeek-V3-shaped mini), the rest as it was measured."""
        parts = self.gap_parts()
        return self.measured_terms_gap(weights, terms) + parts["rest"]

    def measured_terms_gap(self, weights: float, terms: dict[str, float]) -> float:
        """The part of :meth:`gap_for` vLLM's log measured term by term: the weights ("Model loading took") and,
        at the same captures, the CUDA graphs. It holds at settings that moved the activation too far for the
        rest to teach anything (the GLM-4.5-Air mini, 2026-12-06: its graphs logged 0.90 GiB at vLLM's defaults
        and at 2,048 batched tokens with 8k context, its activation peak 4.63 and 2.41 GiB)."""
        parts = self.gap_parts()
        planned_weights = self.predicted_weight_gib * 2**30
        moved = parts["weights"] * (weights / planned_weights if planned_weights else 1.0)
        return moved + (parts["cuda_graphs"] if self.same_graphs(terms) else 0.0)


def history_path() -> Path:
    from servebook import models

    return models.cache_root() / "plans.jsonl"


def remember(entry: Measured) -> None:
    """Append one start's figures to the history (one JSON line each, written whole; the last 500 kept)."""
    files.append_line(history_path(), entry.model_dump_json(), keep=500)


def history() -> list[Measured]:
    """Every start the history holds (a line from another version is skipped: never fail a plan for it)."""
    return files.read_lines(history_path(), Measured.model_validate_json)


def version_key(version: str) -> str:
    return ".".join(version.split(".")[:2])


def moved_bytes(entry: Measured, terms: dict[str, float]) -> float:
    """How far the reserve's terms a plan predicts lie from those planned for an earlier start (bytes)."""
    return sum(abs(size - entry.predicted_terms.get(name, 0.0)) for name, size in terms.items())


def measured_entry(
    at_hand: list[Measured],
    key: str,
    gpu: str,
    vllm: str,
    layout: str,
    settings: dict[str, str],
    *,
    terms: dict[str, float] | None = None,
) -> tuple[Measured | None, bool]:
    """The history's best match for this figure: same signature, GPU and vLLM version; the same layout and
    settings first, then the start whose reserve the plan moves least (with ``terms``; else the most settings
    in common), the newest among equals. (entry, same command)."""
    same = [m for m in at_hand if m.signature == key and m.gpu == gpu and m.vllm == version_key(vllm)]
    if not same:
        return None, False

    def closeness(m: Measured) -> tuple[bool, bool, float, str]:
        near = -moved_bytes(m, terms) if terms is not None else sum(settings.get(k) == v for k, v in m.settings.items())
        return (m.layout == layout, m.settings == settings, near, m.at)

    best = max(same, key=closeness)
    return best, best.layout == layout and best.settings == settings


def workload_key(prompt_ratio: float) -> str:
    """The workload a throughput was measured with, as a forecast matches it: prompt tokens per output token."""
    return f"{prompt_ratio:.3g} prompt tokens per output token"


# a throughput measured for the same command and workload, taken again: the spread of a sweep's level between
# starts (the H200 table of issue #39: 8,487 to 9,976 tok/s at 64 streams on three real-weight starts)
MEASURED_FORECAST_BAND = 0.10
# where the batch the plan ranks at lies beyond the highest concurrency measured (tok_s_beyond), less sure
BEYOND_MEASURED_FORECAST_BAND = 0.20
# a sweep whose last doubling gained at least this much ended rising (at bench_max_concurrency), not on a plateau
STILL_RISING_GAIN = 0.10
# a rehearsal's throughput ran on dummy weights with a routing simulation: the MoE's real routing can differ
REHEARSED_FORECAST_BAND = 0.25


# settings that move the KV figure but not the speed once the server runs: a plan made after the launch expects a
# compile-cache hit where the launch's own plan expected a miss
SPEED_BLIND_SETTINGS = frozenset({"compile_cache_hit"})


def _speed_settings(settings: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in settings.items() if k not in SPEED_BLIND_SETTINGS}


def throughput_entry(at_hand: list[Measured], planned: Layout, gpu: str, vllm: str, workload: str) -> Measured | None:
    """The history's throughput for this layout: same signature, GPU, vLLM version, layout, settings (those that
    move the speed) and workload; a benchmark on real weights before a rehearsal on dummy ones, the newest among
    equals."""
    wanted = _speed_settings(planned.settings)
    same = [
        m for m in at_hand
        if m.throughput and m.signature == planned.signature and m.gpu == gpu and m.vllm == version_key(vllm)
        and m.layout == planned.name and _speed_settings(m.settings) == wanted and m.workload == workload
    ]  # fmt: skip
    return max(same, key=lambda m: (m.source == "benchmark", m.at)) if same else None


def tok_s_at(points: dict[str, float], batch: float) -> tuple[float, bool]:
    """Output tok/s at ``batch`` streams from measured levels (concurrency as text -> tok/s): interpolated on
    log2 of the concurrency between the levels around it, the lowest below it; beyond the highest level, the
    highest level's. (tok/s, whether ``batch`` lies within the measured levels)."""
    levels = sorted((int(c), v) for c, v in points.items() if v > 0)
    if not levels:
        return 0.0, False
    if batch >= levels[-1][0]:
        return levels[-1][1], batch == levels[-1][0]
    if batch <= levels[0][0]:
        return levels[0][1] * batch / levels[0][0], True
    (c0, v0), (c1, v1) = next((a, b) for a, b in zip(levels, levels[1:], strict=False) if a[0] <= batch <= b[0])
    share = (math.log2(batch) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
    return v0 + share * (v1 - v0), True


def tok_s_beyond(points: dict[str, float], batch: float, model: dict[int, float]) -> tuple[float, bool]:
    """Output tok/s at ``batch`` streams from measured levels, as :func:`tok_s_at`; beyond a sweep that ended still
    rising, its highest level grown as the step ``model`` (concurrency -> tok/s) grows from there, not held flat:
    the H100 rehearsal of 2026-12-07 that stopped at 128 streams, 78 % up on 64, was held at 5,632 tok/s where 256
    streams measured 9,674; grown as the model it forecasts 8,657. A sweep that levelled off keeps its top."""
    value, within = tok_s_at(points, batch)
    levels = sorted((int(c), v) for c, v in points.items() if v > 0)
    if within or len(levels) < 2 or not model:
        return value, within
    (c0, v0), (top, v1) = levels[-2:]
    curve = {str(c): v for c, v in model.items()}
    at_top, there = tok_s_at(curve, top)[0], tok_s_at(curve, batch)[0]
    if v1 < v0 * (1 + STILL_RISING_GAIN) or at_top <= 0:
        return value, within
    return v1 * max(there / at_top, 1.0), within


def learned(
    planned: Layout,
    gpu: str,
    vllm: str,
    source: Literal["launch", "rehearsal", "benchmark"],
    kv_cache_tokens: int,
    *,
    weight_gib: float | None = None,
    graph_gib: float | None = None,
    throughput: dict[str, float] | None = None,
    workload: str = "",
) -> Measured:
    """What a start of a planned layout showed, as the history keeps it (a rehearsal's on dummy weights)."""
    reserve = planned.reserve
    terms = (
        {"activation": reserve.activation, "cuda_graphs": reserve.cuda_graphs, "non_torch": reserve.non_torch}
        if reserve else {}
    )  # fmt: skip
    return Measured(
        at=datetime.now(timezone.utc).isoformat(timespec="seconds"), source=source, signature=planned.signature,
        gpu=gpu, vllm=version_key(vllm), layout=planned.name, settings=planned.settings,
        kv_bytes_per_token=planned.kv_bytes_per_token_per_gpu,
        predicted_kv_tokens=planned.max_kv_tokens - round(planned.learned_bytes / planned.kv_bytes_per_token_per_gpu)
        if planned.kv_bytes_per_token_per_gpu else planned.max_kv_tokens,
        kv_cache_tokens=kv_cache_tokens, predicted_terms=terms,
        predicted_weight_gib=planned.weight_bytes_per_gpu / 2**30, weight_gib=weight_gib, throughput=throughput or {},
        workload=workload if throughput else "", graph_gib=graph_gib,
        real_first_start=reserve.real_first_start if reserve and source == "rehearsal" else 0.0,
    )  # fmt: skip


def graph_band(
    graph_bytes: float, piecewise: int, kind: tuple[str, str], further_bytes: float, spread: float | None = None
) -> float:
    """The CUDA-graph estimate's relative band at first contact: its first captures' and its further PIECEWISE
    graphs' (``piecewise``: how many PIECEWISE graphs; a FULL graph after the first took vLLM's 1 MiB floor on all
    54 committed logs that say; ``kind``: attention kind and quantization, which decide how far a further graph has
    been seen to pass what it is charged, unless ``spread`` says it, sizing.piecewise_spread; ``further_bytes``:
    what the further graphs are charged, sizing.graph_estimate's third figure)."""
    if graph_bytes <= 0:
        return 0.0
    further = max(piecewise - 1, 0)
    first = max(graph_bytes - further_bytes, 0.0)
    if spread is None:
        spread = GRAPH_PER_GRAPH_SPREAD_MEASURED.get(kind, GRAPH_PER_GRAPH_SPREAD_BYTES)
    return (GRAPH_FIRST_CAPTURE_BAND * first + spread * further) / graph_bytes


# GQA's activation where the fit is applied: the widest miss of a GQA start logged at DEBUG where the forward sets the
# peak is 9 % (the MiniMax mini's); where the sampler sets it, the plan's terms are vLLM's own within 3 % and what a
# cold compile leaves for the collector widens the band (sizing._term_bands, gqa_compile_garbage_bound)
GQA_CALIBRATED_ACTIVATION_BAND = 0.15
# GQA's weights: within 0.11 % of what vLLM logged on every committed GQA log the tests and benchmarks read (bf16 and
# block FP8, with and without an MTP layer, 2 to 40 layers, H200 and H100; the widest the GLM-4.5-Air mini's
# -0.10 %), since the loader's RoPE cache and skipped MTP layers are counted (2026-12-07)
GQA_CALIBRATED_WEIGHTS_BAND = 0.005


def term_bands(
    prov: Provenance,
    graph_bytes: float = 0.0,
    piecewise: int = 0,
    kind: tuple[str, str] = ("gqa", "none"),
    further: float = 0.0,
    spread: float | None = None,
) -> dict[str, float]:
    """Each term's relative band; the CUDA graphs' from their two parts unless measured."""
    bands = dict(TERM_BANDS[prov])
    if prov == "calibrated" and kind[0] == "gqa":
        bands["activation"] = GQA_CALIBRATED_ACTIVATION_BAND
        bands["weights"] = GQA_CALIBRATED_WEIGHTS_BAND
    if prov != "measured" and piecewise:
        bands["cuda_graphs"] = graph_band(graph_bytes, piecewise, kind, further, spread)
    return bands


def kv_band(
    weights: float,
    terms: dict[str, float],
    kv_bytes: float,
    prov: Provenance,
    learned_from: Measured | None = None,
    same_command: bool = False,
    *,
    bands: dict[str, float] | None = None,
    varies_bytes: float = 0.0,
) -> float:
    """The KV figure's relative band over the KV memory. At first contact each term's bytes times its band and
    the unmodelled part, taken as independent (root sum of squares); learned from an earlier start, vLLM's
    run-to-run spread, plus (at other settings) half of what the terms moved since and the unmodelled part
    that moves with the settings, added up, plus ``varies_bytes``, what differs from start to start of the very
    command (a cold compile's garbage, under GQA and block-FP8 MLA). ``bands``: each term's
    (:func:`term_bands`), else the provenance's."""
    if kv_bytes <= 0:
        return math.inf
    if learned_from is not None and same_command:
        return SAME_COMMAND_KV_BAND + varies_bytes / kv_bytes
    if learned_from is not None:
        moved = moved_bytes(learned_from, terms)
        return (
            SAME_COMMAND_KV_BAND + (MOVED_TERMS_SHARE * moved + UNMODELLED_BYTES["measured"] + varies_bytes) / kv_bytes
        )
    bands = bands or TERM_BANDS[prov]
    parts = [weights * bands["weights"], UNMODELLED_BYTES[prov], *(size * bands[name] for name, size in terms.items())]
    return math.sqrt(sum(part * part for part in parts)) / kv_bytes
