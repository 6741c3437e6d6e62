"""What limits each level of a sweep (the client, the batch, the KV cache, the API server, a link, power, heat,
the server, a decline), named only from what was measured, and the rules that stop a sweep (a plateau, a
decline, a broken objective, the largest concurrency).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from servebook import gpu_evidence, metrics

if TYPE_CHECKING:
    pass


from servebook.levels import Level, LimitKind, SweepConfig, off_clock

# "dropped": a rehearsal stopped a candidate that was behind the leader beyond noise (rehearsal.drop_rule)
StopReason = Literal["plateau", "decline", "max_concurrency", "objective", "fault", "interrupted", "dropped"]
CLIENT_BOUND_PCT = 90.0  # one asyncio process near a full core paces the server instead of measuring it
KV_FULL = 0.95


def plateau_reached(throughputs: list[float], gain: float) -> bool:
    """True when the last two doublings together raised throughput by less than ``gain``."""
    if len(throughputs) < 3:
        return False
    base = throughputs[-3]
    return base > 0 and max(throughputs[-2:]) < base * (1 + gain)


def plateau_level(levels: list[int], throughputs: list[float], gain: float) -> int | None:
    """The lowest concurrency already within ``gain`` of the best throughput."""
    if not throughputs:
        return None
    best = max(throughputs)
    return next(c for c, t in zip(levels, throughputs) if t >= best * (1 - gain))


def failover_text(level: Level) -> str:
    """Behind a router: the replicas that stopped answering during the level, what the router retried and what was
    lost; '' when every replica answered and nothing was retried."""
    if not level.dead_replicas and not level.router_retries and not level.failed:
        return ""
    dead = f"{', '.join(level.dead_replicas)} stopped answering; " if level.dead_replicas else ""
    retried = (
        f"the router retried {level.router_retries:.0f} request(s) on another replica"
        f" ({level.router_retries_exhausted:.0f} ran out of retries), "
        if level.router_retries is not None
        else ""
    )
    return f"{dead}{retried}{level.failed} request(s) lost" if dead or retried else ""


def limit_of(level: Level, gain: float | None, cfg: SweepConfig) -> tuple[LimitKind, str]:
    """What limits a level, from what was gathered during it; ``gain`` is its throughput over the previous
    level's. The client is checked first: it must never silently be the limit."""
    waiting = level.waiting_peak or 0.0
    running = level.running_peak or 0.0
    if level.client_cpu_pct is not None and level.client_cpu_pct >= CLIENT_BOUND_PCT:
        n = int(level.client_processes or 1)
        return "client", (
            f"client-bound: {'each of ' + str(n) + ' client processes' if n > 1 else 'the load generator'} used "
            f"{level.client_cpu_pct:.0f} % of a core, so the server may have had more to give (raise "
            "bench_client_processes, on a machine with cores to spare)"
        )
    # More streams than max_num_seqs: the rest wait in vLLM's queue by arithmetic, whatever was sampled. vLLM's
    # gauges can read 0 between samples, or miss a level altogether (an API server starved of CPU answers
    # /metrics late); the queue-time histogram, counted over the whole window, shows the wait all the same.
    if cfg.max_num_seqs and level.concurrency > cfg.max_num_seqs:
        queued = max(waiting, level.concurrency - running)
        held = (
            f"{running:.0f} running, {queued:.0f} waiting"
            if running >= cfg.max_num_seqs
            else f"{level.concurrency} streams for {cfg.max_num_seqs} slots"
        )
        wait = (
            f"; requests waited {level.server_queue_ms:.0f} ms on average in vLLM's queue"
            if level.server_queue_ms is not None
            else ""
        )
        return "batch", f"batch limit max_num_seqs={cfg.max_num_seqs}: {held}{wait}"
    usage = level.kv_cache_usage_peak or 0.0
    if usage >= KV_FULL or (level.preemptions and waiting > 0):
        return "kv_cache", (
            f"KV cache full: {usage:.0%} used, {waiting:.0f} waiting, {level.preemptions:.0f} preemptions"
        )
    if inside_noise(level, gain, cfg):
        return "noise", (
            f"within noise: {gain:+.0%} over the level before, inside this level's own spread of "
            f"±{(level.spread_pct or 0) / 2:.0f} %: no limit is named on it (longer windows or more repeats decide)"
        )
    if off_clock(level) and (gain is None or gain < cfg.plateau_gain):  # binds, as a wall, once the gain stops
        return "api_server", (
            f"API-server-bound: vLLM's engine had the first token after {level.vllm_ttft_mean_ms or 0:.0f} ms and "
            f"the rest {level.vllm_tpot_mean_ms or 0:.1f} ms apart, but they reached the client after "
            f"{level.client_ttft_mean_ms or 0:.0f} ms and {level.client_tpot_mean_ms or 0:.1f} ms apart (means): "
            "the API server process (HTTP, detokenising, streaming) fell behind the engine; give the server more "
            "CPU cores, or keep this client off them"
        )
    wall = gpu_evidence.verdict(level.gpu) if level.gpu else None
    if wall and (gain is None or gain < cfg.plateau_gain):  # a wall binds once throughput stops rising
        kind, words = wall
        return kind, words + (f"; throughput {gain:+.0%} over the level before" if gain is not None else "")  # type: ignore[return-value]
    if gain is None:
        return "rising", "the first level: nothing limits it yet"
    if gain >= cfg.plateau_gain:
        return "rising", f"still rising: not saturated ({gain:+.0%} over the level before)"
    client = (
        "the client's CPU was not measured, so it is a suspect"
        if level.client_cpu_pct is None
        else f"the client used {level.client_cpu_pct:.0f} % of a core"
    )
    # the waiting gauge peaks while new streams' prefills queue for the token budget, below any batch limit
    waits = "nothing waits" if not waiting else f"at most {waiting:.0f} waited in vLLM's queue"
    if gain < -cfg.plateau_gain:
        return "decline", (
            f"declined {gain:+.0%} with {running:.0f} of {level.concurrency} streams running and {waits}; {client}"
        )
    util = level.gpu.sm_util_mean_pct if level.gpu else None
    sm = f"SM busy {util:.0f} %, " if util is not None else ""
    return "server", (
        f"server-bound: {running:.0f} of {level.concurrency} streams run together, {waits}, and doubling "
        f"the streams gained {gain:+.0%}; the batch's compute or memory bandwidth is the wall ({sm}{client})"
    )


def objective_broken(level: Level, objectives: metrics.Objectives) -> str:
    """Which objective the level's median request misses, if any."""
    checks = [
        ("TTFT", objectives.ttft_ms, level.ttft_p50_ms),
        ("TPOT", objectives.tpot_ms, level.tpot_p50_ms),
        ("E2EL", objectives.e2el_ms, level.e2el_p50_ms),
    ]
    for name, limit, value in checks:
        if limit > 0 and value is not None and value > limit:
            return f"median {name} {value:.0f} ms exceeds the {limit:.0f} ms objective"
    return ""


def label_limits(levels: list[Level], cfg: SweepConfig) -> list[Level]:
    """Set each level's limit, judging its gain against the level before it."""
    for i, level in enumerate(levels):
        previous = levels[i - 1].output_throughput if i else 0.0
        gain = level.output_throughput / previous - 1 if previous > 0 else None
        level.limit_kind, level.limit = limit_of(level, gain, cfg)
        ceiling = cfg.decode_ceiling.get(level.concurrency)
        if ceiling:
            level.plan_ceiling_tok_s, level.plan_ceiling_pct = ceiling, 100 * level.output_throughput / ceiling
    return levels


def inside_noise(level: Level, gain: float | None, cfg: SweepConfig) -> bool:
    """Whether the gain a limit would rest on (short of still rising) is inside the level's own repeat spread:
    the newcomer's "server-bound, the wall" at 2 streams, then +174 % at the next level."""
    if gain is None or gain >= cfg.plateau_gain or not level.spread_pct or level.repeats < 2:
        return False
    half_spread = level.spread_pct / 100 / 2  # a plateau is a gain under plateau_gain: the spread must resolve it
    return half_spread > max(cfg.plateau_gain, abs(gain))


def declined(levels: list[Level], gain: float) -> Level | None:
    """The best level, when the newest one fell past it by more than ``gain`` in every repeat of both: past
    saturation (the best level's own slowest repeat, so one lucky window there is no decline later)."""
    if len(levels) < 2:
        return None
    best = max(levels[:-1], key=lambda lv: lv.output_throughput)
    newest = levels[-1]
    floor = min(best.output_throughput, best.output_throughput_min or best.output_throughput)
    return best if newest.output_throughput_max < floor * (1 - gain) else None


def unresolved_plateau(measured: list[Level], cfg: SweepConfig) -> bool:
    """Whether either of the last two doublings' gains lies inside its level's own repeat spread: on two CPU cores
    (a fresh server stalls the first time it meets a batch shape) 2, 4 and 8 streams once read 620, 651 and 523
    tok/s with repeats 34 to 57 % apart, and the sweep stopped on a "plateau" its own levels called noise. Such a
    sweep goes on: the next doubling (up to max_concurrency) costs one level, a plateau called too early the
    rest of the curve."""
    throughputs = [lv.output_throughput for lv in measured]
    return any(
        inside_noise(measured[i], doubling_gain(throughputs[: i + 1]), cfg)
        for i in range(max(len(measured) - 2, 0), len(measured))
    )


def doubling_gain(throughputs: list[float]) -> float | None:
    """The last doubling's gain in output throughput (0.05: 5 % more); None before two levels."""
    return throughputs[-1] / throughputs[-2] - 1 if len(throughputs) >= 2 and throughputs[-2] > 0 else None


class Stop(NamedTuple):
    by: StopReason
    reason: str  # said for a person, with the figure that decided it


def stop_rule(measured: list[Level], cfg: SweepConfig) -> Stop | None:
    """Whether the sweep stops after its newest level: a broken objective, a decline past the best level, or a
    plateau over two doublings."""
    level = measured[-1]
    if broken := objective_broken(level, cfg.objectives):
        return Stop("objective", f"latency objective broken at concurrency {level.concurrency}: {broken}")
    if peak := declined(measured, cfg.plateau_gain):
        return Stop(
            "decline",
            f"past saturation: throughput fell to {level.output_throughput:,.0f} tok/s at concurrency "
            f"{level.concurrency}, {1 - level.output_throughput / peak.output_throughput:.0%} below its best "
            f"({peak.output_throughput:,.0f} tok/s at {peak.concurrency}) in every repeat",
        )
    throughputs = [lv.output_throughput for lv in measured]
    if plateau_reached(throughputs, cfg.plateau_gain) and not unresolved_plateau(measured, cfg):
        return Stop(
            "plateau",
            f"plateau: under {cfg.plateau_gain:.0%} gain over the last two doublings "
            f"(concurrency {measured[-3].concurrency} to {level.concurrency})",
        )
    return None


def not_saturated(throughputs: list[float], cfg: SweepConfig) -> str:
    """Why a sweep that reached max_concurrency is not a plateau, with the last doubling's gain."""
    last_gain = doubling_gain(throughputs)
    if last_gain is None:
        trend = ""
    elif last_gain >= cfg.plateau_gain:
        trend = f", throughput still rising ({last_gain:+.0%} over the last doubling)"
    else:
        trend = (
            f", throughput flat over the last doubling ({last_gain:+.0%}); a plateau needs two such doublings: "
            "raise bench_max_concurrency"
        )
    return f"reached bench_max_concurrency {cfg.max_concurrency} before a plateau{trend}: not saturated"
