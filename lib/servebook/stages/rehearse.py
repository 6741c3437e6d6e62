"""Stage 02 (rehearse): the candidate servers started on dummy weights, swept briefly, stopped and ranked by what
they measured, recorded in ``02_rehearse.json``; stage 03 launches the winner with real weights."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from pandas.io.formats.style import Styler

from servebook import (
    bench,
    download,
    hardware,
    models,
    modelspec,
    planner,
    rehearsal,
    results,
    server,
    startplan,
    ui,
    vllm_compat,
)
from servebook.errors import RehearsalFailed, ServebookError
from servebook.levels import SweepConfig
from servebook.params import Params
from servebook.records import DownloadRecord, PlanRecord, ReconRecord, RehearsalRecord

# what a dummy-weight start reads: the config, the tokenizer, the index (quantization, tied weights), templates
HEADER_PATTERNS = ["*.json", "tokenizer*", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def model_folder(p: Params, run_dir: Path) -> str:
    """What the dummy starts read: the download's folder when it finished, the embedded or local model, else the
    hub checkpoint's config and tokenizer fetched (megabytes, while the weights download) into the folder the
    download fills. vLLM keys its torch.compile cache by the model's path among the rest (vllm/config/model.py
    ``compute_hash``: ``model`` is not an ignored factor), so the real launch of the winner, from that folder,
    loads what the winner's rehearsal compiled: a shorter start, and on a GQA model none of the up to 1.5 GiB a
    cold compile leaves in vLLM's profile peak (more KV cache)."""
    downloaded = results.read(run_dir, DownloadRecord)
    if downloaded:
        return downloaded.local_path
    if models.is_builtin(p.model) or Path(p.model).expanduser().is_dir():
        return models.resolve(p.model)
    listing = download.list_files(p.model, p.download_revision, allow=HEADER_PATTERNS)
    target = download.local_dir_for(p.model_store, p.model)
    download.fetch(listing, target, workers=4)
    print(f"{listing.repo}: config and tokenizer ({len(listing.files)} files) in {target}, where the download puts "
          "them (the real launch then finds the rehearsal's compile cache); no weights read")  # fmt: skip
    return str(target)


def gpus() -> list[int]:
    """Every GPU of this machine (the live panel's): the candidates' layouts use different ones."""
    return [g.index for g in hardware.inventory().gpus]


def rehearsal_sweep(p: Params) -> SweepConfig:
    """A short sweep with the params' workload and objectives: two windows per level (their range is the noise
    band), doubling to the plateau, and at least to ab_concurrency where stage 06 reuses the windows."""
    return SweepConfig(
        workload=bench.workload_for(p),
        max_concurrency=min(p.rehearse_max_concurrency, p.bench_max_concurrency),
        repeats=2,
        prompts_per_level=p.bench_prompts_per_level,
        min_level_s=p.rehearse_min_level_s,
        max_spread_pct=p.bench_max_spread_pct,
        max_repeats=2,
        plateau_gain=p.bench_plateau_gain,
        objectives=bench.objectives_for(p),
        request_timeout_s=p.bench_request_timeout_s,
        client_processes=p.bench_client_processes,
        # stage 06's A/B reuses these windows for its dummy pass only where every server reached its concurrency
        reach=p.ab_concurrency if p.ab_variants and p.ab_on_dummy is not False else 0,
    )


def candidates(p: Params, run_dir: Path, model_path: str) -> list[rehearsal.CandidateSpec]:
    """The launch's layout and the plan's best others, each as set and with every rehearse_variants setting."""
    recon, plan = results.read(run_dir, ReconRecord), results.read(run_dir, PlanRecord)
    device = recon.device if recon and p.device == "auto" else hardware.resolve_device(p.device, hardware.inventory())
    launch_p = plan.params_for_launch(p) if plan else p
    base = server.ServerConfig.from_params(
        launch_p, device, plan.layout_for_launch if plan else None, model_path=model_path
    )
    specs = rehearsal.candidates(base, plan, p.rehearse_variants, p.rehearse_layouts)
    return [dataclasses.replace(s, predicted=planned_as_set(launch_p, plan, s)) for s in specs]


SIZING_FIELDS = ("max_model_len", "gpu_memory_utilization", "kv_cache_dtype", "enforce_eager", "max_num_seqs",
                 "max_num_batched_tokens")  # fmt: skip


def planned_as_set(p: Params, plan: PlanRecord | None, spec: rehearsal.CandidateSpec) -> planner.Layout | None:
    """The plan's figures for a candidate at its own settings: a setting that moves the reserve (max_num_seqs, the
    batched tokens, eager mode…) is planned again, so its KV is checked against its own prediction."""
    if plan is None or not spec.changes or plan.device.kind == "cpu":
        return spec.predicted
    settings = {name: getattr(spec.config, name) for name in SIZING_FIELDS}
    try:
        return startplan.plan(p.updated(settings, source="rehearse_variants"), plan.device).find(spec.layout)
    except ServebookError:
        return spec.predicted


def run(
    p: Params,
    run_dir: str | Path,
    on_candidate: Callable[[RehearsalRecord], None] | None = None,
) -> RehearsalRecord:
    """Rehearse every candidate within the budget; the record is written after each one, so an interrupt keeps the
    finished ones. ``on_candidate`` sees the record so far (the notebook's live table). How long it ran beside the
    download the runner writes into the record afterwards, from both stages' times."""
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, RehearsalRecord)
    started = time.monotonic()
    model_path = model_folder(p, run_dir)
    specs = candidates(p, run_dir, model_path)
    plan = results.read(run_dir, PlanRecord)
    moe = modelspec.load(model_path).is_moe
    device = specs[0].config.device if specs else "cpu"
    routing, routing_note = rehearsal.routing_for(moe, p.rehearse_routing, device)
    record = RehearsalRecord(
        model_path=model_path, routing=routing, routing_note=routing_note, candidates=[],
        ranked_by="goodput" if bench.objectives_for(p) else "output tok/s", budget_s=p.rehearse_budget_s,
    )  # fmt: skip
    runner = rehearsal.Runner(
        rehearsal_sweep(p), run_dir / RehearsalRecord.FILE, routing, moe, stop_leftovers=p.stop_leftovers,
        on_progress=ui.load_progress(p.interactive, "dummy start"),
    )  # fmt: skip
    print(f"{len(specs)} candidates: " + "; ".join(s.name for s in specs))
    print(f"routing simulation: {routing}" if routing else f"no routing simulation: {routing_note}")
    parse_ahead(specs, routing, moe)
    try:
        for spec in specs:
            elapsed = time.monotonic() - started
            if p.rehearse_budget_s and elapsed > p.rehearse_budget_s:
                record.candidates.append(_skipped(spec, f"over the rehearsal budget ({p.rehearse_budget_s:.0f} s)"))
                continue
            found = runner.rehearse(spec, leader(record))
            record.candidates.append(found)
            if plan and runner.last_values:
                startplan.learn(
                    plan, spec.predicted, runner.last_values, "rehearsal",
                    throughput={str(pt.concurrency): pt.output_tok_s for pt in found.points} if found.routing else None,
                    prompt_ratio=p.bench_input_len / p.bench_output_len,
                )  # fmt: skip
            _decide(record)
            _keep(run_dir, record, started, on_candidate)
        _skewed(p, record, specs, runner)
        _keep(run_dir, record, started, on_candidate)
        _prime(p, record, specs, runner, started)
    except KeyboardInterrupt:
        record.interrupted = "interrupted; the candidates finished before it are kept"
        _keep(run_dir, record, started, on_candidate)
        raise
    _keep(run_dir, record, started, on_candidate)
    return record


def parse_ahead(specs: list[rehearsal.CandidateSpec], routing: str, moe: bool) -> None:
    """Every candidate's dummy-weight command, its real-weight launch and, after a routed rehearsal, the priming
    start's command through vLLM's parser at once: one import of the parser (10-15 s a command on an H200 host,
    before each start) instead of one per command."""
    commands = [
        c.serve_args()
        for s in specs
        for c in (rehearsal.routing_env(s.config, routing, moe), s.config, *([s.config.dry()] if routing else []))
    ]
    if not commands:
        return
    started = time.monotonic()
    if parsed := vllm_compat.parse_ahead(specs[0].config.model_path, commands):
        print(f"vLLM's parser read {parsed} command lines in {time.monotonic() - started:.1f} s, once for all")


def leader(record: RehearsalRecord) -> rehearsal.Rehearsed | None:
    by_goodput = record.ranked_by == "goodput"
    ranked = rehearsal.rank(list(record.candidates), by_goodput)
    return ranked[0] if ranked else None


def _skipped(spec: rehearsal.CandidateSpec, why: str) -> rehearsal.Rehearsed:
    return rehearsal.Rehearsed(
        name=spec.name, layout=spec.layout, setting=spec.setting, changes=spec.changes, status="skipped", error=why
    )


def _decide(record: RehearsalRecord) -> None:
    """Rank what was measured; the leader wins unless a person picked another."""
    by_goodput = record.ranked_by == "goodput"
    ranked = rehearsal.rank(record.candidates, by_goodput)
    if not ranked:
        record.winner, record.why = "", "no candidate started and measured"
        return
    best = ranked[0]
    if record.picked_by != "person" or not record.find(record.winner):
        record.winner, record.picked_by = best.name, "measurement"
    top, band = best.best, best.band(by_goodput)
    unproven = [
        r for r in ranked[1:] if r.behind_baseline and (r.score(by_goodput) or 0) > (best.score(by_goodput) or 0)
    ]
    tied = [r.name for r in ranked[1:] if r not in unproven and rehearsal.within_noise(best, r, by_goodput)]
    unit = "requests/s within the objectives" if by_goodput else "output tok/s"
    record.why = (
        f"{best.name}: {best.score(by_goodput):,.1f} {unit}"
        + (f" at {top.concurrency} streams" if top and not by_goodput else "")
        + (f" (repeats {band[0]:,.1f}-{band[1]:,.1f})" if band else "")
        + "".join(f"; {r.name} scored higher but has not shown it beats it: {r.behind_baseline}" for r in unproven)
        + (f"; within noise of it: {', '.join(tied)}" if tied else "; every other candidate is behind beyond noise"
           if len(ranked) > 1 + len(unproven) else "")
    )  # fmt: skip


def _skewed(
    p: Params,
    record: RehearsalRecord,
    specs: list[rehearsal.CandidateSpec],
    runner: rehearsal.Runner,
) -> None:
    """The leader again with the skewed routing: how much a trained router's skew may cost it."""
    other = p.rehearse_skewed_routing
    best = leader(record)
    if not record.routing or other in ("none", record.routing) or best is None:
        return
    spec = next(s for s in specs if s.name == best.name)
    best.skewed = runner.skewed(spec, best, other)


def _prime(
    p: Params,
    record: RehearsalRecord,
    specs: list[rehearsal.CandidateSpec],
    runner: rehearsal.Runner,
    started: float,
) -> None:
    """The winner once more as stage 03 will start it, where its launch would otherwise compile cold."""
    chosen = record.chosen
    if not p.rehearse_primes_compile_cache or chosen is None:
        return
    spec = next(s for s in specs if s.name == chosen.name)
    why_not = rehearsal.priming_not_needed(spec.config, chosen)
    if not why_not and p.rehearse_budget_s and time.monotonic() - started > p.rehearse_budget_s:
        why_not = f"over the rehearsal budget ({p.rehearse_budget_s:.0f} s): the launch compiles cold"
    if why_not:
        record.primed = rehearsal.Primed(candidate=chosen.name, skipped=why_not)
        return
    record.primed = runner.prime(chosen.name, spec.config)
    if record.primed.error:
        print(f"{chosen.name}: the priming start failed, so the launch compiles cold: {record.primed.error[:300]}")


def _keep(
    run_dir: Path,
    record: RehearsalRecord,
    started: float,
    on_candidate: Callable[[RehearsalRecord], None] | None,
) -> None:
    record.seconds = round(time.monotonic() - started, 1)
    results.write(run_dir, record)
    if on_candidate:
        on_candidate(record)


def pick(run_dir: str | Path, name: str) -> RehearsalRecord:
    """A person's choice of winner (the notebook's picker): stage 03 launches it, the record says who chose."""
    run_dir = results.run_folder(run_dir)
    record = results.require(run_dir, RehearsalRecord, "the rehearsal's picker")
    found = record.find(name)
    if found is None or found.status not in ("measured", "dropped"):
        measured = [c.name for c in record.candidates if c.status in ("measured", "dropped")]
        raise RehearsalFailed(f"'{name}' was not measured in this rehearsal; pick one of: {', '.join(measured)}")
    record.winner, record.picked_by = name, "person"
    record.why = f"{name}: picked by a person over the measurement's leader"
    results.write(run_dir, record)
    return record


def check(record: RehearsalRecord, p: Params) -> None:
    if record.interrupted:
        raise KeyboardInterrupt
    if not record.winner:
        causes = [f"{c.name}: {c.status}: {' '.join(c.error.split())[:400]}" for c in record.candidates]
        raise RehearsalFailed("no candidate started and measured on dummy weights:\n  - " + "\n  - ".join(causes))


def summary(record: RehearsalRecord) -> str:
    measured = sum(c.status in ("measured", "dropped") for c in record.candidates)
    failed = sum(c.status == "failed" for c in record.candidates)
    parts = [f"{measured} of {len(record.candidates)} candidates measured on dummy weights"]
    if failed:
        parts.append(f"{failed} did not start")
    if record.winner:
        parts.append(f"winner {record.winner} ({record.picked_by})")
    chosen = record.chosen
    if chosen and chosen.skewed and chosen.skewed.change_pct is not None:
        parts.append(f"{chosen.skewed.change_pct:+.0f} % with {chosen.skewed.routing} routing")
    if record.primed and not record.primed.skipped and not record.primed.error:
        parts.append(f"the launch's compile cache primed in {record.primed.seconds:,.0f} s")
    return "; ".join(parts)


def table(record: RehearsalRecord) -> pd.DataFrame:
    """One row per candidate: its start, KV against the plan, best level with its band, and rank."""
    rows = []
    for c in record.candidates:
        best = c.best
        rows.append({
            "rank": c.rank, "candidate": c.name, "status": c.status,
            "ready s": c.seconds_to_ready, "compile cache": _compile_cache(c),
            "KV tokens": c.kv_cache_tokens, "plan KV tokens": c.predicted_kv_tokens,
            "plan KV error %": c.kv_error_pct,
            "KV tokens, first real start": c.real_kv_tokens_expected,
            "best tok/s": best.output_tok_s if best else None,
            "band": f"{best.low:,.1f}-{best.high:,.1f}" if best else "",
            "at streams": best.concurrency if best else None,
            "plan forecast tok/s": c.predicted_forecast_tok_s,
            "plan ceiling tok/s": c.predicted_ceiling_tok_s,
            "skewed routing %": c.skewed.change_pct if c.skewed else None,
            "seconds": c.seconds,
            "why": c.behind_baseline or (c.error.splitlines()[0][:160] if c.error else c.stop_reason),
        })  # fmt: skip
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    if frame["KV tokens, first real start"].isna().all():  # only where real weights keep more (MLA)
        frame = frame.drop(columns="KV tokens, first real start")
    return frame.sort_values("rank", na_position="last", kind="stable")


def _compile_cache(c: rehearsal.Rehearsed) -> str:
    """The start's torch.compile cache: hit, miss, not compiled (enforce_eager); blank for a start that failed."""
    return c.compile_cache or ("not compiled" if c.seconds_to_ready is not None else "")


def styled(record: RehearsalRecord) -> Styler:
    """The table as a person reads it: no index column, thousands separated, blanks for what was not measured."""
    frame = table(record)
    counts = [
        c for c in ("rank", "KV tokens", "plan KV tokens", "KV tokens, first real start", "at streams") if c in frame
    ]
    return (
        frame.style.hide(axis="index")
        .format(na_rep="", precision=1, thousands=",")
        .format("{:,.0f}", subset=counts, na_rep="")
    )


def points(record: RehearsalRecord) -> pd.DataFrame:
    """Every rehearsed level of every candidate, for the chart."""
    return points_of(record.candidates)


def points_of(found: list[rehearsal.Rehearsed]) -> pd.DataFrame:
    columns = ["candidate", *rehearsal.Point.model_fields]
    return pd.DataFrame([{"candidate": c.name, **pt.model_dump()} for c in found for pt in c.points], columns=columns)


def launch_wait(record: RehearsalRecord) -> str:
    """What a person reads under the table: who wins, why, and what stage 03 does with it."""
    if not record.winner:
        return "No candidate was measured: stage 03 launches what the plan and params say."
    lines = [f"**Winner:** {record.why}."]
    if record.routing:
        lines.append(
            f"Every candidate ran with vLLM's `{record.routing}` routing simulation: dummy weights' own router sends "
            "most tokens to a few experts and would rehearse too fast."
        )
    elif record.routing_note:
        lines.append(f"No routing simulation: {record.routing_note}.")
    chosen = record.chosen
    if chosen and chosen.skewed:
        s = chosen.skewed
        lines.append(
            f"With `{s.routing}` routing (a skew closer to a trained router's) it measured "
            + (f"{s.output_tok_s:,.1f} tok/s at {s.concurrency} streams ({s.change_pct:+.1f} %)." if s.output_tok_s
               else f"nothing: {s.error}")
        )  # fmt: skip
    if chosen and chosen.layout.ep and record.routing:
        lines.append(
            "Expert parallelism: uniform routing balances the experts' ranks perfectly; a trained router does not, "
            "so this layout may rehearse optimistic (stage 05 measures the real gap)."
        )
    if primed := _primed_line(record):
        lines.append(primed)
    if record.download_overlap_s:
        lines.append(f"{record.download_overlap_s:,.0f} s of the rehearsal ran while the download was running.")
    return "\n\n".join(lines)


def _primed_line(record: RehearsalRecord) -> str:
    """What the launch's compile cache will be, after the priming start or without it."""
    primed = record.primed
    if primed is None:
        return ""
    if primed.error:
        return (
            f"**Compile cache:** the priming start of {primed.candidate} failed, so stage 03 compiles cold: "
            + (" ".join(primed.error.split())[:300])
        )
    if primed.skipped:
        return f"**Compile cache:** no priming start: {primed.skipped}."
    compiled = f"compiled in {primed.compile_s:,.1f} s, " if primed.compile_s else ""
    return (
        f"**Compile cache:** {primed.candidate} was started once more on dummy weights exactly as stage 03 starts "
        f"it, without the routing simulation (vLLM hashes that variable into its compile key): {compiled}ready in "
        f"{primed.seconds_to_ready or 0:,.1f} s. The launch loads that compile instead of compiling cold, and is "
        "planned as such a start."
    )


def failed_start(record: RehearsalRecord) -> list[str]:
    """Each candidate that did not start, with vLLM's root cause."""
    return [f"{c.name}: {c.error}" for c in record.candidates if c.status == "failed"]
