"""End-to-end A/B of server variants, with a winner called only above run-to-run noise.

Each variant (environment variables and/or serving parameters) is launched through
``server.launch``, measured at one stream and at a high concurrency with the benchmark
stage's load generator, and compared with the baseline, which is measured before and after
the variants (across a relaunch) so its own spread is the noise band.  A variant is
"better" or "worse" only when its median differs from the baseline's by more than that
band (and by more than 2 %); "likely better" or "likely worse" where the medians are inside the band yet every
sample of the variant lies beyond the baseline's range (one cold baseline window can widen the band: worth a
longer A/B); otherwise "no effect".  A variant whose server fails to start is reported with the root
cause, and the sweep goes on.

Every variant costs a relaunch, and a relaunch of a 547 GB model is minutes: before the first one the A/B says
what its relaunches will cost at the measured start time (more where a variant changes a flag the compile cache
is keyed on), records what each one cost, and flags a variant that stayed inside the baseline's noise band as
not worth its relaunch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from servebook import client, levels, loadgen, metrics, remote, server, serving, startup
from servebook.client import Target
from servebook.errors import AbFailed, LaunchError, PreflightError, ServebookError
from servebook.params import AbVariant

MIN_NOISE = 0.02  # never call a difference under 2 % a win, however quiet the baseline was
BASELINE = "baseline"


class AbRow(BaseModel):
    """One variant at one concurrency against the baseline."""

    variant: str
    concurrency: int
    verdict: Literal["better", "worse", "likely better", "likely worse", "no effect", "failed to start"]
    change: float | None  # relative change of the median output throughput (a fraction: 0.05 is 5 %)
    noise: float  # the baseline's own spread at this concurrency (a fraction)
    samples_apart: bool = False  # every variant sample beyond every baseline sample, whatever the band
    baseline_median: float | None = None  # output tok/s
    variant_median: float | None = None  # output tok/s
    cause: str = ""


class Relaunch(BaseModel):
    """What one relaunch of the A/B cost, against what it was expected to cost."""

    name: str
    expected_s: float
    seconds_to_ready: float | None = None  # None: it failed to start
    compile_cache: str | None = None
    reused: bool = False


class RelaunchCost(BaseModel):
    """The A/B's relaunches, said before the first one and measured as each ran."""

    start_s: float  # the start this A/B was priced at
    start_basis: str = "the measured start"
    compile_miss_s: float  # what a variant that changes a compile-key flag adds
    relaunches: list[Relaunch]

    @property
    def expected_s(self) -> float:
        return sum(r.expected_s for r in self.relaunches)

    @property
    def spent_s(self) -> float:
        return sum(r.seconds_to_ready or 0.0 for r in self.relaunches)

    def describe(self) -> str:
        misses = [r.name for r in self.relaunches if r.expected_s > self.start_s]
        verb = "changes" if len(misses) == 1 else "change"
        extra = (
            f"; {', '.join(misses)} {verb} a flag the compile cache is keyed on (+{self.compile_miss_s:.0f} s each)"
            if misses
            else ""
        )
        count = f"{len(self.relaunches)} relaunch{'es' if len(self.relaunches) != 1 else ''}"
        return (
            f"{count} at about {self.start_s:.0f} s each ({self.start_basis}){extra}: "
            f"about {self.expected_s / 60:.1f} min of starts before any measurement"
        )


class AbResult(BaseModel):
    variants: list[AbVariant]
    samples: dict[str, dict[str, list[float]]]  # variant -> concurrency -> output tok/s per repeat
    rows: list[AbRow]
    failures: dict[str, str]  # variant -> root cause of its failed start
    concurrencies: list[int]
    workload: loadgen.Workload
    cost: RelaunchCost | None = None

    def variant(self, name: str) -> AbVariant:
        return next(v for v in self.variants if v.name == name)

    def not_worth_relaunching(self) -> dict[str, float]:
        """Variants inside the baseline's noise band at every concurrency, with what their relaunch cost (s)."""
        spent = {r.name: r.seconds_to_ready or r.expected_s for r in self.cost.relaunches} if self.cost else {}
        by_variant: dict[str, list[AbRow]] = {}
        for row in self.rows:
            by_variant.setdefault(row.variant, []).append(row)
        return {
            name: spent.get(name, 0.0)
            for name, rows in by_variant.items()
            if rows and all(r.verdict == "no effect" for r in rows)
        }


def variant_config(base: server.ServerConfig, variant: AbVariant) -> server.ServerConfig:
    changes = variant.changes()
    if layout := {k: changes.pop(k) for k in serving.LAYOUT if k in changes}:
        changes["layout"] = base.layout.updated(layout)
    if "extra_env" in changes:
        changes["extra_env"] = {**base.extra_env, **changes["extra_env"]}
    if "extra_args" in changes:
        changes["extra_args"] = [*base.extra_args, *changes["extra_args"]]
    return replace(base, **changes)


def verdict(
    base: list[float], variant: list[float], noise: float
) -> tuple[Literal["better", "worse", "no effect"], float]:
    """('better' | 'worse' | 'no effect', relative change of the medians)."""
    b, v = statistics.median(base), statistics.median(variant)
    change = (v - b) / b if b else 0.0
    if abs(change) <= max(MIN_NOISE, noise):
        return "no effect", change
    return ("better" if change > 0 else "worse"), change


def worded(base: list[float], variant: list[float], noise: float) -> tuple[str, float, bool]:
    """The verdict as the table words it, its change, and whether every sample lies apart: a change inside the
    baseline's band with every sample beyond its range (and beyond the 2 % floor) is "likely" so, never "no effect"
    (the newcomer's −43 %, every sample apart, read "no effect")."""
    call, change = verdict(base, variant, noise)
    apart = samples_apart(base, variant, change)
    if call == "no effect" and apart and abs(change) > MIN_NOISE:
        return ("likely better" if change > 0 else "likely worse"), change, apart
    return call, change, apart


def samples_apart(base: list[float], variant: list[float], change: float) -> bool:
    """Every sample of the variant beyond every sample of the baseline, in the direction of the change: worth a
    longer A/B where the band is wide (the H200 run of 2026-12-01: eager [3,172, 4,716] against a baseline of
    [5,397, 16,405, 17,259, 18,513] whose cold first window made a 78 % band)."""
    return max(variant) < min(base) if change < 0 else min(variant) > max(base)


def noise_band(samples: list[float]) -> float:
    """The baseline's own spread relative to its median: (max − min) / median, at least MIN_NOISE."""
    if len(samples) < 2:
        return max(MIN_NOISE, 0.05)
    med = statistics.median(samples)
    return max(MIN_NOISE, (max(samples) - min(samples)) / med if med else 0.0)


@dataclass(frozen=True)
class AbPlan:
    """What every A/B point measures: the workload, the concurrencies, and each window's size."""

    workload: loadgen.Workload
    concurrencies: list[int]
    requests: int = 32  # measured requests per window (at least 4 per stream)
    repeats: int = 2
    min_seconds: float = 0.0


def measure(target: Target, maker: loadgen.PromptMaker, plan: AbPlan) -> dict[int, list[float]]:
    """Output tok/s per concurrency, ``repeats`` times, on a ready server, with the benchmark's own requests
    (single turns: the A/B compares servers, not conversations), each window at least ``requests``
    requests (4 per stream) and ``min_seconds`` long.  A first window at a concurrency that ends sooner only
    sizes the next (a 2-second window at 64 streams on an H200 held one stall and a 78 % spread)."""
    out: dict[int, list[float]] = {c: [] for c in plan.concurrencies}
    rates: dict[int, float] = {}
    stall_s: dict[int, float] = {}  # each concurrency's bound, from its last window
    overhead = maker.chat_overhead() if plan.workload.endpoint == "chat" else 0
    for _ in range(plan.repeats):
        for c in plan.concurrencies:
            while True:
                least = max(plan.requests, 4 * c)
                sized = c in rates
                count = levels.prompts_for_window(least, plan.min_seconds, rates.get(c)) + c
                prompts = loadgen.synthetic_prompts(maker, count, plan.workload, overhead)
                window = loadgen.run_level(
                    target, plan.workload, prompts, concurrency=c, warmup=c, min_requests=least,
                    min_seconds=plan.min_seconds, stall_s=stall_s.get(c, client.STALL.min_s),
                )  # fmt: skip
                s = metrics.summarize(window.records)
                if window.stalled:
                    raise AbFailed(client.hung_engine(target.url, window.stalled, f"concurrency {c}"))
                if s.failed:
                    raise AbFailed(f"{s.failed} requests failed at concurrency {c}: {s.errors}")
                rates[c] = s.request_throughput
                stall_s[c] = client.STALL.after(s.ttft_ms.p99, s.tpot_ms.p99)
                if sized or s.duration_s >= plan.min_seconds:
                    out[c].append(s.output_throughput)
                    break
    return out


AcrossNodes = Callable[[server.ServerConfig, Path], tuple[server.ServerConfig, list[remote.WorkerRecord]]]


def _launch(cfg: server.ServerConfig, folder: Path, across_nodes: AcrossNodes | None) -> server.Launch:
    """Start one configuration (on every node) and leave it running."""
    head, workers = across_nodes(cfg, folder) if across_nodes else (cfg, [])
    return server.launch(head, folder, log=lambda _m: None, workers=workers)


def _measure_variant(
    name: str, cfg: server.ServerConfig, folder: Path, plan: AbPlan, across_nodes: AcrossNodes | None
) -> tuple[server.Launch, dict[int, list[float]]]:
    """Launch one variant (on every node), measure it with the server's own key, leave it running."""
    launched = _launch(cfg, folder, across_nodes)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(cfg.model_path), seed=7)
    return launched, measure(launched.config.target(), maker, plan)


def price(
    base: server.ServerConfig,
    order: list[tuple[str, server.ServerConfig]],
    start: tuple[float, str],
    compile_miss_s: float,
) -> RelaunchCost:
    """What the relaunches after the first (reused) server will cost: the measured start each, plus a compile
    miss for a variant that compiles (not under enforce_eager) and whose compile key differs from the baseline's."""
    key = startup.compile_key(base, None)

    def misses(cfg: server.ServerConfig) -> bool:
        return not cfg.enforce_eager and startup.compile_key(cfg, None) != key

    start_s, basis = start
    return RelaunchCost(
        start_s=start_s,
        start_basis=basis,
        compile_miss_s=compile_miss_s,
        relaunches=[
            Relaunch(name=name, expected_s=start_s + (compile_miss_s if misses(cfg) else 0.0))
            for name, cfg in order[1:]
        ],
    )


def run(
    base: server.ServerConfig,
    variants: list[AbVariant],
    log_dir: Path,
    plan: AbPlan,
    *,
    log: Callable[[str], None] = print,
    across_nodes: AcrossNodes | None = None,
    start: tuple[float, str] = (0.0, "not measured"),
    compile_miss_s: float = 0.0,
    fresh: bool = False,
) -> AbResult:
    """Baseline, each variant, baseline again; return samples, noise bands and verdicts. Leaves the baseline running.
    ``fresh``: no server of the baseline runs yet (the dummy-weight pass), so its first start is priced too.

    ``across_nodes`` (``multinode.prepare`` for the run's nodes) turns each configuration into the head's and the
    other nodes' commands, so a variant's flags and environment reach every node, as NCCL settings must.
    ``start`` (seconds and where from: the launch stage's measured start) and ``compile_miss_s`` price the
    relaunches before the first."""
    samples: dict[str, dict[int, list[float]]] = {}
    others = different(base, variants, log)
    failures = refused(base, others, log)
    viable = [v for v in others if v.name not in failures]
    order = [(BASELINE, base)] + [(v.name, variant_config(base, v)) for v in viable] + [(BASELINE, base)]
    priced = [(BASELINE, base), *order] if fresh else order  # price() prices every start after the first
    cost = price(base, priced if viable else [], start, compile_miss_s)
    if not viable:  # nothing to compare: no server is started or stopped for it
        log("A/B: no variant left to compare (refused, or the baseline itself); the running server is left as it is")
        return _result(others, samples, failures, plan, cost)
    log(f"A/B: {cost.describe()}")
    shift = 0 if fresh else 1
    steps = [
        Step(name, cfg, cost.relaunches[i - shift] if i >= shift else None, i) for i, (name, cfg) in enumerate(order)
    ]
    _run_steps(steps, log_dir, plan, samples, failures, log=log, across_nodes=across_nodes)
    return _result(others, samples, failures, plan, cost)


def different(base: server.ServerConfig, variants: list[AbVariant], log: Callable[[str], None]) -> list[AbVariant]:
    """The variants that start another server than the baseline: one the launch already runs (the rehearsal picked
    that setting) would only measure the noise, and costs a start."""
    kept = []
    for v in variants:
        if variant_config(base, v).fingerprint() == base.fingerprint():
            log(f"A/B {v.name}: the baseline already runs it (the launch took this setting); not compared")
        else:
            kept.append(v)
    return kept


def refused(base: server.ServerConfig, variants: list[AbVariant], log: Callable[[str], None]) -> dict[str, str]:
    """Variants vLLM's parser refuses (an unknown flag or variable), each with vLLM's message: found in a second,
    before any server is stopped or started for them."""
    found = {}
    for v in variants:
        try:
            server.check_command(variant_config(base, v))
        except PreflightError as exc:
            found[v.name] = " ".join(str(exc).split())[:600]
            log(f"A/B {v.name}: refused before any start: {found[v.name]}")
    return found


def _result(
    variants: list[AbVariant],
    samples: dict[str, dict[int, list[float]]],
    failures: dict[str, str],
    plan: AbPlan,
    cost: RelaunchCost,
) -> AbResult:
    return AbResult(
        variants=variants,
        samples={n: {str(c): v for c, v in s.items()} for n, s in samples.items()},
        rows=_rows(variants, samples, failures, plan.concurrencies),
        failures=failures,
        concurrencies=plan.concurrencies,
        workload=plan.workload,
        cost=cost,
    )


@dataclass
class Step:
    """One server of an A/B's order: launched (or, first of all, reused), measured, left running."""

    name: str
    config: server.ServerConfig
    relaunch: Relaunch | None  # None: the running server is measured as it is, where it matches
    index: int


def _run_steps(
    steps: list[Step],
    log_dir: Path,
    plan: AbPlan,
    samples: dict[str, dict[int, list[float]]],
    failures: dict[str, str],
    *,
    log: Callable[[str], None],
    across_nodes: AcrossNodes | None,
) -> None:
    """Each step in turn, its samples added to ``samples``; a failed start is recorded in ``failures``."""
    for step in steps:
        name, relaunch = step.name, step.relaunch
        log(f"A/B {name}: launching" + ("" if relaunch else " (or reusing the running server)"))
        try:
            if relaunch:  # one server at a time on the port: stop whatever holds it first
                server.stop(port=step.config.port)
            folder = log_dir / f"ab-{step.index:02d}-{name}"
            launched, got = _measure_variant(name, step.config, folder, plan, across_nodes)
        except ServebookError as exc:
            cause = exc.cause if isinstance(exc, LaunchError) else ""
            failures[name] = cause or " ".join(str(exc).split())[:600]
            log(f"A/B {name}: failed: {failures[name]}")
            continue
        if relaunch:
            _took(relaunch, launched, log)
        for c, values in got.items():
            samples.setdefault(name, {}).setdefault(c, []).extend(values)
        log(f"A/B {name}: " + ", ".join(f"c={c} {statistics.median(v):.1f} tok/s" for c, v in got.items()))


def _took(relaunch: Relaunch, launched: server.Launch, log: Callable[[str], None]) -> None:
    relaunch.seconds_to_ready, relaunch.reused = launched.seconds_to_ready, launched.reused
    relaunch.compile_cache = launched.timeline.compile_cache if launched.timeline else None
    cache = f", compile cache {relaunch.compile_cache}" if relaunch.compile_cache else ""
    log(
        f"A/B {relaunch.name}: relaunch took {launched.seconds_to_ready:.0f} s "
        f"(expected {relaunch.expected_s:.0f}{cache})"
    )


# ---------------------------------------------------------------- rehearsed on dummy weights, confirmed on real ones

PROMISING = ("better", "likely better")


def promising(result: AbResult) -> str:
    """The variant to confirm on the real weights: better (or likely so) at every concurrency, the one whose
    smallest gain is largest; '' when none is."""
    by_variant: dict[str, list[AbRow]] = {}
    for row in result.rows:
        by_variant.setdefault(row.variant, []).append(row)
    ahead = {
        v: min(r.change or 0.0 for r in rows)
        for v, rows in by_variant.items()
        if all(r.verdict in PROMISING for r in rows)
    }
    return max(ahead, key=lambda v: ahead[v]) if ahead else ""


class RehearsedAb(BaseModel):
    """The A/B rehearsed on dummy weights and confirmed on the real server."""

    dummy: AbResult  # every variant against a dummy-weight baseline
    real: AbResult  # the real baseline before and after, and the dummy A/B's winner, if there was one
    winner: str  # the variant confirmed on the real weights; '' when none beat the dummy baseline's noise
    routing: str = ""  # the MoE routing simulation the dummy servers ran with
    from_rehearsal: bool = False  # the dummy pass is stage 02's measurements: no dummy server started here

    def saved_s(self) -> float:
        """The real relaunches the rehearsal spared: the variants never started with real weights, at the real
        start's price."""
        restart = (
            0 if self.winner else int(self.from_rehearsal)
        )  # the real server's restart, too, where it never stopped
        spared = len(self.dummy.variants) - (1 if self.winner else 0) + restart
        return spared * (self.real.cost.start_s if self.real.cost else 0.0)


@dataclass(frozen=True)
class DummyWeights:
    """How the rehearsal's servers are made from the real ones, and what one of their starts costs."""

    make: Callable[[server.ServerConfig], server.ServerConfig]  # --load-format dummy (and a MoE's routing simulation)
    routing: str = ""  # the routing simulation ``make`` sets, '' for none
    start: tuple[float, str] = (0.0, "not measured")  # seconds to ready, and where the figure comes from


def dummy_pass_pays(
    base: server.ServerConfig, variants: list[AbVariant], real_start_s: float, dummy_start_s: float
) -> tuple[bool, str]:
    """Whether rehearsing the variants on dummy weights saves time, and why. On real weights the A/B starts each
    variant once and the baseline once more: (n + 1) real starts. On dummy weights it starts a dummy baseline
    before and after and each variant, then the real weights once (twice if a variant wins): (n + 2) dummy starts
    and one real. Dummy weights pay only where the weights' read makes a real start dearer than that."""
    others = different(base, variants, _quiet)
    n = len(others) - len(refused(base, others, _quiet))
    real, dummy = (n + 1) * real_start_s, (n + 2) * dummy_start_s + real_start_s
    if n == 0:
        return False, "no variant would start another server: nothing to rehearse"
    figures = (
        f"{n} variant(s): about {real:.0f} s of starts on the real weights against {dummy:.0f} s on dummy "
        f"weights (a real start {real_start_s:.0f} s, a dummy start {dummy_start_s:.0f} s)"
    )
    if dummy < real:
        return True, f"on dummy weights first: {figures}"
    return False, f"on the real weights: {figures}; dummy weights would not save time, their read is short"


def _quiet(_message: str) -> None:
    pass


OWN_DUMMY_PASS = "then every variant rehearsed on dummy weights"
STAGE_02_PASS = (
    "every variant was measured on dummy weights by stage 02's rehearsal (the same servers and workload), so "
    "nothing is started for that pass"
)


def run_rehearsed(
    base: server.ServerConfig,
    variants: list[AbVariant],
    log_dir: Path,
    plan: AbPlan,
    dummy: DummyWeights,
    *,
    log: Callable[[str], None] = print,
    across_nodes: AcrossNodes | None = None,
    start: tuple[float, str] = (0.0, "not measured"),
    compile_miss_s: float = 0.0,
    already: AbResult | None = None,
) -> RehearsedAb:
    """The A/B with real relaunches only for what earned one.

    1. The running real server (the baseline) is measured as it is: no relaunch.
    2. It is stopped, and every variant is compared on dummy weights (``dummy.make``: ``--load-format dummy``, with
       the routing simulation of a MoE): a dummy baseline before and after, so the comparison has its own noise band.
    3. The variant better (or likely better) at every concurrency there is started on the real weights and measured,
       then the real baseline is started again and measured: the winner is judged against the real baseline's
       samples from before and after, as in :func:`run`. Without such a variant, only the real baseline is
       started again (the server the later stages use). Real relaunches: two, or one, instead of one per variant.

    ``already``: the dummy pass as stage 02's rehearsal measured it (the same dummy servers and workload), so step 2
    starts nothing and the real server keeps running unless a variant earned its confirmation: no relaunch at all
    where none did."""
    samples: dict[str, dict[int, list[float]]] = {}
    others = different(base, variants, _quiet)
    if already is None and len(refused(base, others, _quiet)) == len(others):  # the dummy pass says which and why
        nothing = run(dummy.make(base), variants, log_dir / "dummy", plan, log=lambda m: log(f"dummy weights: {m}"))
        no_cost = price(base, [], start, compile_miss_s)
        return RehearsedAb(dummy=nothing, real=_result([], {}, {}, plan, no_cost), winner="", routing=dummy.routing)
    failures: dict[str, str] = {}
    first = [Step(BASELINE, base, None, 0)]
    reused = already is not None
    log("A/B: the running server measured as it is; " + (STAGE_02_PASS if reused else OWN_DUMMY_PASS))
    _run_steps(first, log_dir, plan, samples, failures, log=log, across_nodes=across_nodes)
    if failures:
        raise AbFailed(f"the running server could not be measured: {failures[BASELINE]}")
    rehearsed = already
    if rehearsed is None:  # a dummy pass of its own: the real server stops for it
        server.stop(port=base.port)
        rehearsed = run(
            dummy.make(base),
            variants,  # each variant over the dummy baseline (variant_config merges its environment into the dummy's)
            log_dir / "dummy",
            plan,
            log=lambda m: log(f"dummy weights: {m}"),
            across_nodes=across_nodes,
            start=dummy.start,
            compile_miss_s=compile_miss_s,
            fresh=True,
        )
    winner = promising(rehearsed)
    chosen = [v for v in variants if v.name == winner]
    order = [(BASELINE, base)] + [(v.name, variant_config(base, v)) for v in chosen] + [(BASELINE, base)]
    kept_running = reused and not winner  # the real server never stopped and nothing earned a start
    cost = price(base, [] if kept_running else order, start, compile_miss_s)
    log(
        f"A/B: {winner} beat the dummy baseline; confirming it on the real weights: {cost.describe()}"
        if winner
        else "A/B: no variant beat the dummy baseline's noise; "
        + ("the real server keeps running, no relaunch" if kept_running else "restarting the real server")
    )
    if winner:
        steps = [Step(name, cfg, cost.relaunches[i - 1], i) for i, (name, cfg) in enumerate(order) if i]
        _run_steps(steps, log_dir, plan, samples, failures, log=log, across_nodes=across_nodes)
    elif not kept_running:  # the baseline only needs to run again, not to be measured
        server.stop(port=base.port)
        launched = _launch(base, log_dir / "ab-restored-baseline", across_nodes)
        _took(cost.relaunches[-1], launched, log)
    real = _result(chosen, samples, failures, plan, cost)
    return RehearsedAb(dummy=rehearsed, real=real, winner=winner, routing=dummy.routing, from_rehearsal=reused)


def _rows(
    variants: list[AbVariant],
    samples: dict[str, dict[int, list[float]]],
    failures: dict[str, str],
    concurrencies: list[int],
) -> list[AbRow]:
    """Each variant at each concurrency against the baseline's samples and noise band."""
    rows = []
    base_samples = samples.get(BASELINE, {})
    for c in concurrencies:
        noise = noise_band(base_samples.get(c, []))
        for v in variants:
            if v.name in failures:
                rows.append(
                    AbRow(
                        variant=v.name, concurrency=c, verdict="failed to start", change=None, noise=noise,
                        cause=failures[v.name],
                    )
                )  # fmt: skip
                continue
            if not base_samples.get(c) or not samples.get(v.name, {}).get(c):
                continue
            call, change, apart = worded(base_samples[c], samples[v.name][c], noise)
            rows.append(
                AbRow(
                    variant=v.name, concurrency=c, verdict=call, change=change, noise=noise, samples_apart=apart,
                    baseline_median=statistics.median(base_samples[c]),
                    variant_median=statistics.median(samples[v.name][c]),
                )
            )  # fmt: skip
    return rows


@dataclass(frozen=True)
class RehearsedServer:
    """One candidate of stage 02's rehearsal, as the A/B needs it: its exact dummy command, the environment its
    setting added to the params' own, and its windows' output tok/s by concurrency."""

    command_line: str
    added_env: dict[str, str]
    samples: dict[int, list[float]]


def from_rehearsal(
    base: server.ServerConfig,
    variants: list[AbVariant],
    plan: AbPlan,
    dummy: DummyWeights,
    rehearsed: list[RehearsedServer],
) -> tuple[AbResult | None, str]:
    """The A/B's dummy pass out of the rehearsal's measurements, where it already started the very servers the pass
    would (the same dummy command and environment as the baseline and each variant) and measured them at every
    concurrency of the A/B with the same workload; otherwise (None, why not)."""
    if not rehearsed:
        return None, "no rehearsal was measured in this run"
    if plan.workload.turns > 1:
        return None, "the rehearsal sweeps conversations, the A/B single turns"
    others = different(base, variants, _quiet)
    failures = refused(base, others, _quiet)
    wanted: list[tuple[str, server.ServerConfig, dict[str, str]]] = [(BASELINE, base, {})] + [
        (v.name, variant_config(base, v), v.extra_env or {}) for v in others if v.name not in failures
    ]
    samples: dict[str, dict[int, list[float]]] = {}
    for name, cfg, added_env in wanted:
        line = " ".join(dummy.make(cfg).command())
        match = next((r for r in rehearsed if r.command_line == line and r.added_env == added_env), None)
        if match is None:
            return None, f"the rehearsal did not start the server of {name}"
        missing = [c for c in plan.concurrencies if not match.samples.get(c)]
        if missing:
            return None, f"the rehearsal did not measure {name} at concurrency {', '.join(map(str, missing))}"
        samples[name] = {c: match.samples[c] for c in plan.concurrencies}
    return _result(others, samples, failures, plan, price(base, [], dummy.start, 0.0)), ""
