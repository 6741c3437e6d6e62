"""Stage 06: the collective micro-benchmark, the server A/B, and the environment to deploy with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from servebook import ab, bench, modelspec, multinode, nccl, rehearsal, results, server, startup
from servebook.params import Params
from servebook.records import LaunchRecord, NcclTuningRecord, RehearsalRecord

NCCL_PREFIX = ("NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS")
REUSED = (
    "on dummy weights first, as stage 02's rehearsal measured them: it started the baseline's and every variant's "
    "server on dummy weights with this workload, so the A/B starts none of them again"
)
VERDICT_COLOURS = {
    "better": "#2ca02c", "likely better": "#98df8a", "worse": "#d62728", "likely worse": "#ff9896",
    "no effect": "#7f7f7f", "failed to start": "#000000",
}  # fmt: skip


def micro(p: Params, log: Callable[[str], None] = print) -> nccl.MicroResult:
    sets = p.nccl_sets or list(nccl.DEFAULT_SETS)
    sweep = nccl.Sweep("auto", p.nccl_world, p.nccl_min_bytes, p.nccl_max_bytes, p.nccl_iters, p.nccl_warmup)
    return nccl.run_all(sweep, sets, log=log)


def compile_miss_cost(launch: LaunchRecord) -> float:
    """What a relaunch that misses the compile cache adds: the launch's own compile and profile where it missed,
    else the defaults of a miss over a hit on this device."""
    d = startup.DEFAULT_PHASES.get(launch.config.device, startup.DEFAULT_PHASES["cuda"])
    hit = d["compile_hit"] + d["memory_profiling_hit"]
    tl = launch.timeline
    if tl and tl.compile_cache == "miss":
        return max(0.0, tl.seconds("compile") + tl.seconds("memory_profiling") - hit)
    return d["compile_miss"] + d["memory_profiling_miss"] - hit


def start_cost(launch: LaunchRecord) -> tuple[float, str]:
    """(seconds, where from) a relaunch of this server takes: its measured start, else the plan's prediction."""
    if not launch.reused and launch.seconds_to_ready:
        return launch.seconds_to_ready, "the measured start"
    if launch.start_prediction:
        return launch.start_prediction.total_s, "the plan's prediction; the server was reused, not started"
    return 0.0, "unknown: the server was reused and no plan predicted its start"


def dummy_start_cost(launch: LaunchRecord) -> tuple[float, str]:
    """(seconds, where from) a dummy-weight start of this server takes: its start less the weights' read."""
    seconds, basis = start_cost(launch)
    if launch.timeline and not launch.reused:
        read = launch.timeline.seconds("weights_read")
    else:
        read = launch.start_prediction.phases.get("weights_read", 0.0) if launch.start_prediction else 0.0
    return max(0.0, seconds - read), f"{basis}, less its weights' read ({read:.0f} s)" if read >= 1 else basis


def rehearsal_notes(rehearsed: ab.RehearsedAb | None) -> list[str]:
    """What the dummy-weight A/B decided, and which real relaunches it spared."""
    if not rehearsed:
        return []
    names = [v.name for v in rehearsed.dummy.variants]
    routing = f" with {rehearsed.routing} routing" if rehearsed.routing else ""
    spared = [n for n in names if n != rehearsed.winner]
    said = f"{len(names)} variant(s) rehearsed on dummy weights{routing}" + (
        " by stage 02 (its windows are the dummy pass: no dummy server started here)"
        if rehearsed.from_rehearsal
        else ""
    )
    if rehearsed.winner:
        said += f"; {rehearsed.winner} beat the dummy baseline and was confirmed on the real weights"
    else:
        said += "; none beat the dummy baseline's noise band, so none was started with the real weights" + (
            " and the real server was never stopped" if rehearsed.from_rehearsal else ""
        )
    if spared:
        said += (
            f" ({', '.join(spared)} never relaunched with the real weights: about {rehearsed.saved_s():.0f} s of real "
            "starts spared)"
        )
    return [said]


def recommend(result: ab.AbResult | None) -> tuple[dict[str, str], str, list[str]]:
    """The environment to deploy with: the default unless an NCCL-only variant wins at every concurrency."""
    if not result:
        return {}, "no server A/B ran: deploy with the default environment", []
    by_variant: dict[str, list[ab.AbRow]] = {}
    for row in result.rows:
        by_variant.setdefault(row.variant, []).append(row)
    winners = [v for v, rows in by_variant.items() if rows and all(r.verdict == "better" for r in rows)]
    other = [
        f"{v}: better at every concurrency, but it changes serving flags; apply it to the launch parameters if wanted"
        for v in winners
        if not result.variant(v).environment_only
    ]
    other += [
        f"{v}: inside the baseline's noise band at every concurrency: not worth its relaunch ({seconds:.0f} s here, "
        "and every relaunch of the deployed model pays it again)"
        for v, seconds in result.not_worth_relaunching().items()
    ]
    env_winners = [v for v in winners if result.variant(v).environment_only]
    if not env_winners:
        return (
            {},
            "no environment set beat run-to-run noise at every concurrency: deploy with the default environment",
            other,
        )
    best = max(env_winners, key=lambda v: min(r.change or 0.0 for r in by_variant[v]))
    env = {k: v for k, v in (result.variant(best).extra_env or {}).items() if k.startswith(NCCL_PREFIX)}
    return env, f"{best} beat the baseline beyond its noise band at every concurrency", other


def dummy_weights(p: Params, launch: LaunchRecord) -> tuple[ab.DummyWeights, str]:
    """The A/B's dummy-weight servers: the rehearsal's (``--load-format dummy``, a MoE's routing simulation), and
    why a MoE's run without that simulation ('' where it has one or needs none)."""
    base: server.ServerConfig = launch.config
    moe = modelspec.load(base.model_path).is_moe
    routing, why_none = rehearsal.routing_for(moe, p.rehearse_routing, base.device)
    make = ab.DummyWeights(lambda cfg: rehearsal.routing_env(cfg, routing, moe), routing, dummy_start_cost(launch))
    return make, why_none if moe and not routing else ""


def rehearsed_servers(run_dir: Path, model_path: str) -> list[ab.RehearsedServer]:
    """Stage 02's measured candidates with their windows' throughput, for the A/B's dummy pass (the command lines
    name the launch's checkpoint, where the rehearsal read another folder)."""
    record = results.read(run_dir, RehearsalRecord)
    if record is None:
        return []
    found = []
    for candidate in record.candidates:
        runs_file = run_dir / RehearsalRecord.FILE / rehearsal.slug_of(candidate.name) / "sweep_runs.parquet"
        if candidate.status not in ("measured", "dropped") or not runs_file.is_file():  # a drop keeps its windows
            continue
        runs = pd.read_parquet(runs_file, columns=["concurrency", "output_throughput"])
        samples = {int(c): [float(x) for x in tok_s] for c, tok_s in runs.groupby("concurrency").output_throughput}
        line = candidate.command_line.replace(record.model_path, model_path)
        added = candidate.changes.get("extra_env") or {}
        env = {str(k): str(v) for k, v in added.items()} if isinstance(added, dict) else {}
        found.append(ab.RehearsedServer(line, env, samples))
    return found


def ab_weights(p: Params, launch: LaunchRecord) -> tuple[bool, str]:
    """(on dummy weights first, why): as ``ab_on_dummy`` says, or with "auto" wherever the dummy pass saves starts."""
    if p.ab_on_dummy != "auto":
        return bool(p.ab_on_dummy), (
            "on dummy weights first (ab_on_dummy: true)"
            if p.ab_on_dummy
            else "on the real weights (ab_on_dummy: false)"
        )
    return ab.dummy_pass_pays(launch.config, p.ab_variants, start_cost(launch)[0], dummy_start_cost(launch)[0])


def run(p: Params, run_dir: str | Path, log: Callable[[str], None] = print) -> NcclTuningRecord:
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, NcclTuningRecord)  # a rerun never leaves the last attempt's record looking current
    measured = micro(p, log)
    compared, rehearsed, why = None, None, ""
    if p.ab_variants:
        launch = results.require(run_dir, LaunchRecord, "nccl_tuning")
        base: server.ServerConfig = launch.config
        plan = ab.AbPlan(
            workload=bench.workload_for(p),
            concurrencies=sorted({1, p.ab_concurrency}),
            requests=p.ab_requests,
            repeats=p.ab_repeats,
            min_seconds=p.bench_min_level_s,
        )
        nodes = multinode.NodeSet.for_nodes(p.nodes_section) if p.nodes > 1 else None
        across = (lambda cfg, folder: multinode.prepare(cfg, nodes, folder)) if nodes else None
        dummy, no_routing = dummy_weights(p, launch)
        already, not_reused = None, ""
        if p.ab_on_dummy is not False:
            servers = rehearsed_servers(run_dir, base.model_path)
            already, not_reused = ab.from_rehearsal(base, p.ab_variants, plan, dummy, servers)
        on_dummy, why = (True, REUSED) if already else ab_weights(p, launch)
        log(f"A/B {why}" + (f" (not from the rehearsal: {not_reused})" if not_reused else ""))
        if on_dummy and no_routing:
            log(f"A/B on dummy weights without a routing simulation: {no_routing}")
        if on_dummy:
            rehearsed = ab.run_rehearsed(
                base, p.ab_variants, run_dir, plan, dummy, log=log, across_nodes=across,
                start=start_cost(launch), compile_miss_s=compile_miss_cost(launch), already=already,
            )  # fmt: skip
            compared = rehearsed.real
        else:
            compared = ab.run(
                base, p.ab_variants, run_dir, plan, log=log, across_nodes=across, start=start_cost(launch),
                compile_miss_s=compile_miss_cost(launch),
            )  # fmt: skip
    env, why, notes = recommend(compared)
    record = NcclTuningRecord(
        micro=measured, ab=compared, rehearsed=rehearsed, recommended_env=env, recommendation=why,
        notes=[f"A/B {why}"] * bool(p.ab_variants) + rehearsal_notes(rehearsed) + notes,
    )  # fmt: skip
    results.write(run_dir, record)
    return record


def check(record: NcclTuningRecord, p: Params) -> None:
    """Nothing to stop on: a harmful set or a variant that fails to start is a finding, not a failure."""


def summary(record: NcclTuningRecord) -> str:
    env = " ".join(f"{k}={v}" for k, v in record.recommended_env.items())
    deploy_with = f"deploy with `{env}`" if env else "deploy with the default environment"
    where = "NCCL" if record.micro.on_gpus else "gloo on the CPU (no NCCL figures)"
    if record.rehearsed:
        winner = record.rehearsed.winner
        confirmed = f"{winner} confirmed on the real weights" if winner else "none worth a real relaunch"
        variants = (
            f", {len(record.rehearsed.dummy.variants)} server variant(s) rehearsed on dummy weights ({confirmed})"
        )
    else:
        variants = f", {len(record.ab.variants)} server variant(s) compared" if record.ab else ""
    likely = sorted(
        {
            f"{r.variant} {r.verdict}"
            for _, result in passes(record)
            for r in result.rows
            if r.verdict.startswith("likely")
        }
    )
    unsure = f" ({'; '.join(likely)}: every sample apart inside a wide band, worth a longer A/B)" if likely else ""
    return f"{deploy_with}; collectives measured with {where}{variants}{unsure}"


def bandwidth_table(record: NcclTuningRecord) -> pd.DataFrame:
    return pd.DataFrame([{"set": s.name, **row.model_dump()} for s in record.micro.sets for row in s.rows])


def bandwidth_figures(record: NcclTuningRecord) -> list[go.Figure]:
    """Bus bandwidth against message size, and the latency of small messages, per set and collective."""
    bw = bandwidth_table(record)
    if bw.empty:
        return []
    harmful = {row.set for row in record.micro.summary if row.harmful}
    bw["set"] = [f"{s} (harmful)" if s in harmful else s for s in bw["set"]]
    labels = {"busbw_gbs": "bus bandwidth (GB/s)", "bytes": "message bytes", "time_us": "time per operation (µs)"}
    return [
        px.line(
            bw,
            x="bytes",
            y="busbw_gbs",
            color="set",
            facet_col="collective",
            log_x=True,
            markers=True,
            title="Bus bandwidth against message size",
            labels=labels,
        ),
        px.line(
            bw[bw["bytes"] <= nccl.SMALL_BYTES],
            x="bytes",
            y="time_us",
            color="set",
            facet_col="collective",
            log_x=True,
            markers=True,
            title="Latency of small messages",
            labels=labels,
        ),
    ]


FROM_REHEARSAL = "stage 02's dummy"  # reads "(stage 02's dummy weights)" in the chart


def passes(record: NcclTuningRecord) -> list[tuple[str, ab.AbResult]]:
    """The A/B's passes, each with the weights it ran on: dummy first (ab_on_dummy; stage 02's windows where the
    rehearsal ran its servers), then real."""
    rehearsed = record.rehearsed
    found = [(FROM_REHEARSAL if rehearsed.from_rehearsal else "dummy", rehearsed.dummy)] if rehearsed else []
    return found + ([("real", record.ab)] if record.ab else [])


def pass_costs(record: NcclTuningRecord) -> list[str]:
    """What each pass cost in server starts, in words: the estimate before its first relaunch and what it spent."""
    said = []
    for weights, result in passes(record):
        if result.cost is None:
            continue
        if result.cost.relaunches:
            said.append(
                f"{weights} weights, before: {result.cost.describe()}; spent: {result.cost.spent_s / 60:.1f} min"
            )
        elif weights == FROM_REHEARSAL:
            said.append("dummy weights: stage 02's rehearsal windows of the same servers; no server started for them")
        else:
            said.append(f"{weights} weights: the running server measured as it is; no relaunch")
    return said


def relaunch_table(record: NcclTuningRecord) -> pd.DataFrame:
    """Each relaunch of the A/B, on which weights: what it was expected to cost and what it took."""
    rows = [
        {
            "weights": weights,
            "relaunch": r.name,
            "expected s": round(r.expected_s),
            "took s": "failed to start" if r.seconds_to_ready is None else round(r.seconds_to_ready),
            "compile cache": r.compile_cache or "not used",
        }
        for weights, result in passes(record)
        if result.cost
        for r in result.cost.relaunches
    ]
    return pd.DataFrame(rows).set_index(["weights", "relaunch"]) if rows else pd.DataFrame()


def ab_table(record: NcclTuningRecord) -> pd.DataFrame:
    """The A/B in percent, each change beside the baseline's noise band that decides its verdict; with
    ab_on_dummy, the dummy-weight pass's rows above the real pass's."""
    rows = [
        {
            "weights": weights,
            "variant": r.variant,
            "streams": r.concurrency,
            "verdict": r.verdict,
            "change, %": round(100 * r.change, 1) if r.change is not None else None,
            "noise band, ± %": round(100 * r.noise, 1),
            "every sample apart": r.samples_apart,
            "baseline tok/s": round(r.baseline_median) if r.baseline_median else None,
            "variant tok/s": round(r.variant_median) if r.variant_median else None,
            "cause": r.cause,
        }
        for weights, result in passes(record)
        for r in result.rows
    ]
    return pd.DataFrame(rows).set_index(["weights", "variant", "streams"]) if rows else pd.DataFrame()


def ab_figure(record: NcclTuningRecord) -> go.Figure | None:
    table = ab_table(record)
    if table.empty or table["change, %"].isna().all():
        return None
    table = (
        table.reset_index()
        .dropna(subset=["change, %"])
        .rename(columns={"change, %": "change %", "noise band, ± %": "noise %", "streams": "concurrency"})
    )
    table["variant"] = table["variant"] + " (" + table["weights"] + " weights)"
    return px.bar(
        table,
        x="variant",
        y="change %",
        color="verdict",
        facet_col="concurrency",
        error_y="noise %",
        error_y_minus="noise %",
        color_discrete_map=VERDICT_COLOURS,
        title="Change against the baseline (bars: ± the baseline's noise band)",
    )
