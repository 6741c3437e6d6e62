"""Stage 05: the concurrency sweep against the launched server, and the comparison of runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from pandas.io.formats.style import Styler

from servebook import bench, datasets, multinode, planner, ratesweep, results, startplan, vllm_format
from servebook.errors import ServebookError, SweepAborted
from servebook.levels import Level, SweepConfig, off_clock
from servebook.params import Params
from servebook.records import BenchmarkRecord, LaunchRecord, PlanRecord, RehearsalRecord


def sweep_config(p: Params, max_num_seqs: int = 0) -> SweepConfig:
    return SweepConfig(
        max_num_seqs=max_num_seqs,
        workload=bench.workload_for(p),
        max_concurrency=p.bench_max_concurrency,
        repeats=p.bench_repeats,
        prompts_per_level=p.bench_prompts_per_level,
        min_level_s=p.bench_min_level_s,
        max_spread_pct=p.bench_max_spread_pct,
        max_repeats=max(p.bench_max_repeats, p.bench_repeats),
        plateau_gain=p.bench_plateau_gain,
        objectives=bench.objectives_for(p),
        request_timeout_s=p.bench_request_timeout_s,
        client_processes=p.bench_client_processes,
    )


def admitted_sequences(launch: LaunchRecord, plan: PlanRecord | None) -> int:
    """Sequences the server runs at once, all DP engines together: the launch's max_num_seqs, else vLLM's
    default for the planned device; 0 when neither is known."""
    cfg = launch.config
    per_engine = cfg.max_num_seqs or (
        planner.default_max_num_seqs(plan.device, cfg.layout.tp * cfg.layout.pp) if plan else 0
    )
    return per_engine * cfg.layout.dp


def run(p: Params, run_dir: str | Path, on_level: Callable[[bench.SweepResult], None] | None = None) -> BenchmarkRecord:
    """Sweep the server the launch stage recorded; always write the record, the gate raises on a fault.
    ``on_level`` sees the sweep so far after every level (the notebook's live chart)."""
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, BenchmarkRecord)
    launch = results.require(run_dir, LaunchRecord, "benchmark")
    launch.require_answering("benchmark")
    dataset = load_dataset(p, launch)
    plan = results.read(run_dir, PlanRecord)
    cfg = sweep_config(p, admitted_sequences(launch, plan))
    planned = plan.find(launch.config.layout) if plan else None
    cfg.decode_ceiling = dict(planned.sweep_ceiling) if planned else {}
    cfg.dataset = dataset.prompts if dataset else None
    cfg.gpu_ids = list(launch.gpu_ids) if launch.config.device == "cuda" else []
    target = launch.target(p.bench_request_timeout_s)
    dataset_summary = dataset.summary() if dataset else ""

    def keep(so_far: bench.SweepResult) -> None:  # every level on disk as soon as it is measured
        results.write(run_dir, BenchmarkRecord(**dict(so_far), dataset=dataset_summary))
        if on_level:
            on_level(so_far)

    swept = bench.sweep(target, launch.model_path, cfg, run_dir, table_prefix=BenchmarkRecord.FILE, on_level=keep)
    record = BenchmarkRecord(**dict(swept), dataset=dataset.summary() if dataset else "")
    record.against_rehearsal = against_rehearsal(record, launch, results.read(run_dir, RehearsalRecord))
    if record.fault and launch.workers:  # a multi-node server: which node took it down, in that node's words
        gone = multinode.Workers(launch.workers).gone()
        record.fault += ("; vLLM is gone on " + "; ".join(gone)) if gone else "; every worker node still runs"
    results.write(run_dir, record)
    if plan and planned and not record.fault and not dataset:  # the next plan forecasts this layout from here
        startplan.learn(
            plan, planned, launch.vllm_reported, "benchmark", throughput=measured_levels(record),
            prompt_ratio=p.bench_input_len / p.bench_output_len,
        )  # fmt: skip
    if p.bench_request_rates and not record.fault:
        rates_cfg = rate_config(p)
        rates_cfg.dataset = cfg.dataset
        record.rates = ratesweep.sweep_rates(
            target, launch.model_path, rates_cfg, run_dir, table_prefix=f"{BenchmarkRecord.FILE}_rates"
        )
        record.fault = record.rates.fault
        results.write(run_dir, record)
    return record


def measured_levels(record: BenchmarkRecord) -> dict[str, float]:
    """Output tok/s per concurrency, as the plan history keeps a sweep."""
    return {str(level.concurrency): round(level.output_throughput, 1) for level in record.levels}


def against_rehearsal(record: BenchmarkRecord, launch: LaunchRecord, rehearsed: RehearsalRecord | None) -> str:
    """The real server against its rehearsal on dummy weights, level by level where both measured one."""
    found = rehearsed.matching(launch.config) if rehearsed else None
    if found is None or rehearsed is None:
        return ""
    pairs = [
        (lv.concurrency, lv.output_throughput, pt.output_tok_s)
        for lv in record.levels
        for pt in found.points
        if pt.concurrency == lv.concurrency and pt.output_tok_s
    ]
    if not pairs:
        return ""
    said = ", ".join(f"{c} streams {real:,.0f} against {dummy:,.0f} ({100 * (real - dummy) / dummy:+.0f} %)"
                     for c, real, dummy in pairs)  # fmt: skip
    routing = f"with {rehearsed.routing} routing" if rehearsed.routing else "with the dummy router"
    text = f"real weights against the rehearsal of {found.name} ({routing}), output tok/s: {said}"
    if found.layout.ep:
        text += "; expert parallelism: a trained router's skew loads some ranks more than the simulation did"
    return text


def gpus_of(run_dir: str | Path) -> list[int]:
    """The GPUs the launched server uses (the live panel's); none for a CPU server or without a launch."""
    launch = results.read(results.run_folder(run_dir), LaunchRecord)
    return list(launch.gpu_ids) if launch and launch.config.device == "cuda" else []


def load_dataset(p: Params, launch: LaunchRecord) -> datasets.Dataset | None:
    """The dataset's requests, every one checked against the served tokenizer and max_model_len before any
    request is sent."""
    if not p.bench_dataset:
        return None
    from servebook import loadgen

    tokenizer = loadgen.load_tokenizer(launch.model_path)
    overhead = loadgen.PromptMaker(tokenizer).chat_overhead() if p.bench_endpoint == "chat" else 0
    return datasets.load(
        p.bench_dataset, tokenizer, max_model_len=launch.config.max_model_len, output_len=p.bench_output_len,
        fmt=p.bench_dataset_format, chat_overhead=overhead,
    )  # fmt: skip


def rate_config(p: Params) -> ratesweep.RateSweepConfig:
    return ratesweep.RateSweepConfig(
        rates=list(p.bench_request_rates),
        arrival=p.bench_arrival,
        burstiness=p.bench_burstiness,
        workload=bench.workload_for(p),  # open-loop requests are single turns: the sweep ignores turns
        min_requests=p.bench_rate_requests,
        min_seconds=p.bench_min_level_s,
        objectives=bench.objectives_for(p),
        goodput_target=p.bench_goodput_target_pct / 100,
        request_timeout_s=p.bench_request_timeout_s,
    )


def check(record: BenchmarkRecord, p: Params) -> None:
    if record.fault:
        raise SweepAborted(f"benchmark stopped: {record.fault}; the levels measured before it are saved")


def summary(record: BenchmarkRecord) -> str:
    parts = []
    if record.single_stream:
        parts.append(f"one stream {record.single_stream.output_throughput:,.0f} tok/s")
    if record.best:
        parts.append(f"best {record.best.output_throughput:,.0f} tok/s at {record.best.concurrency} streams")
    if record.saturated:
        parts.append(f"levels off from {record.plateau_concurrency} streams")
    elif record.stopped_by == "max_concurrency":
        parts.append(f"**not saturated** at {record.max_concurrency} streams")
    else:
        parts.append(f"stopped: {record.stop_reason}")
    return "; ".join(parts)


def _figure(value: float | None, unit: str, digits: int = 0) -> str:
    return f"{value:,.{digits}f} {unit}" if value is not None else f"no {unit} (nothing completed)"


def headline_tpot(client_tpot: float | None, level: Level | None) -> str:
    """The one-stream TPOT a headline may show: the client's where it measured the engine's pace, vLLM's own (from
    the one-stream level) where tokens reached the client in bursts (the client's gaps then read near 0 ms, a
    figure it could not measure)."""
    bursty = (level is not None and off_clock(level)) or (client_tpot is not None and client_tpot < 0.05)
    if bursty and level is not None and level.vllm_tpot_mean_ms:
        return f"TPOT {level.vllm_tpot_mean_ms:,.1f} ms by vLLM's clock (tokens reached the client in bursts)"
    if bursty:
        return "TPOT not measurable by the client (tokens reached it in bursts; vLLM's clock was not available)"
    return f"TPOT p50 {_figure(client_tpot, 'ms', 1)}"


def summary_lines(record: BenchmarkRecord, p: Params) -> list[str]:
    """The notebook's summary in Markdown bullets: the workload, why the sweep stopped, its best and one-stream
    figures, its warnings and fault (a level in which nothing completed has no latencies, and says so)."""
    if record.dataset:
        lines = [f"- workload: {record.dataset}"]
    else:
        mix = (
            f"; {p.bench_long_share:.0%} of requests carry {p.bench_long_input_len} prompt tokens instead"
            if p.bench_long_share
            else ""
        )
        lines = [
            f"- workload: synthetic, {p.bench_input_len} prompt and {p.bench_output_len} output tokens per request{mix}"
        ]
    lines.append(f"- stopped: {record.stop_reason}")
    if record.against_rehearsal:
        lines.append(f"- {record.against_rehearsal}")
    if record.best:
        levels_off = (
            f"; levels off from concurrency {record.plateau_concurrency}"
            if record.saturated
            else "; **not saturated**"
            if record.stopped_by == "max_concurrency"
            else ""
        )
        lines.append(
            f"- best output throughput **{record.best.output_throughput:.0f} tok/s** at concurrency "
            f"{record.best.concurrency}{levels_off}"
        )
    if single := record.single_stream:
        lines.append(
            f"- one stream: {single.output_throughput:.1f} output tok/s, TTFT p50 {_figure(single.ttft_p50_ms, 'ms')}, "
            f"{headline_tpot(single.tpot_p50_ms, next((lv for lv in record.levels if lv.concurrency == 1), None))}"
        )
    lines += [f"- ⚠️ {w}" for w in record.warnings]
    if record.fault:
        lines.append(f"- ❌ {record.fault}")
    return lines


def levels(record: BenchmarkRecord) -> pd.DataFrame:
    """One row per level; ``client clock`` marks a level whose client latencies are the API server's delivery,
    not the engine's pace (the client's mean TPOT over 25 % off vLLM's own)."""
    frame = pd.DataFrame([level.flat() for level in record.levels])
    if not frame.empty:
        frame["client clock"] = [
            f"off vLLM's by {lv.tpot_clock_gap_pct:+.0f} %" if off_clock(lv) else "" for lv in record.levels
        ]
    return frame


# what limits each level, as the notebook shows it: source column -> (header, decimals; None: text as it is)
LIMIT_COLUMNS: dict[str, tuple[str, int | None]] = {
    "concurrency": ("streams", 0),
    "client_cpu_pct": ("client CPU, % of a core", 0),
    "running_peak": ("running (peak)", 0),
    "waiting_peak": ("waiting (peak)", 0),
    "server_queue_ms": ("vLLM queue wait, ms", 0),
    "kv_cache_used_pct": ("KV cache used, %", 2),
    "gpu_sm_util_pct": ("SM busy, %", 0),
    "gpu_power_pct": ("power, % of limit", 0),
    "gpu_pcie_pct": ("PCIe, % of link", 1),
    "gpu_nvlink_pct": ("NVLink, % of capacity", 0),
    "gpu_slowdowns": ("clock slowdowns", None),
    "gpu_note": ("GPU note", None),
    "plan_ceiling_tok_s": ("plan's ceiling for this workload, tok/s", 0),
    "plan_ceiling_pct": ("% of that ceiling", 0),
    "limit": ("what limits it", None),
}


def limits_table(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The evidence of what limits each level, rounded and under readable headers, without the columns nothing
    filled (no GPU, no plan); a GPU note every level shares, and NVML's sample counts, go to one line below."""
    table = table.copy()
    if "kv_cache_usage_peak" in table:
        table["kv_cache_used_pct"] = 100 * table["kv_cache_usage_peak"]
    notes: list[str] = []
    if "gpu_samples" in table:
        counts = [int(n) for text in table["gpu_samples"].fillna("") for n in str(text).split(", ") if n]
        if counts:
            lo, hi = min(counts), max(counts)
            notes.append(f"NVML sampled each measurement {lo if lo == hi else f'{lo}–{hi}'} times")
    if "gpu_note" in table and table["gpu_note"].nunique() == 1:
        notes.insert(0, str(table["gpu_note"].iloc[0]))
        table["gpu_note"] = ""
    shown = table[[c for c in LIMIT_COLUMNS if c in table]].replace("", np.nan).dropna(axis=1, how="all")
    for column in shown:
        decimals = LIMIT_COLUMNS[column][1]
        if decimals == 0:
            shown[column] = shown[column].round().astype("Int64")
        elif decimals is not None:
            shown[column] = shown[column].round(decimals)
        else:
            shown[column] = shown[column].fillna("")
    shown = shown.rename(columns={c: LIMIT_COLUMNS[c][0] for c in shown}).set_index("streams")
    return shown, "; ".join(n for n in notes if n)


def _rounded(decimals: int) -> Callable[[float], str]:
    """A number at ``decimals`` places with thousands separators; one that rounds to zero reads 0, never -0."""
    return lambda v: f"{round(v, decimals) + 0.0:,.{decimals}f}"


def _readable(shown: pd.DataFrame, columns: dict[str, tuple[str, int | None]], text_width_em: int) -> Styler:
    """A table under readable headers for a notebook: numbers right-aligned at the decimals ``columns`` gives,
    text columns in full and left-aligned (pandas would cut them at 50 characters)."""
    decimals = {header: d for header, d in columns.values() if d is not None}
    text = [header for header, d in columns.values() if d is None and header in shown]
    props = f"text-align: left; min-width: {text_width_em}em"
    return (
        shown.style.format({c: _rounded(decimals[c]) for c in shown if c in decimals}, na_rep="")
        .set_table_styles(
            [
                {"selector": "th.col_heading", "props": "text-align: right; vertical-align: bottom"},
                {"selector": "td", "props": "text-align: right; padding: 0 0.6em"},
            ]
        )
        .set_table_styles({c: [{"selector": sel, "props": props} for sel in ("", "th")] for c in text}, overwrite=False)
    )


def limits_style(shown: pd.DataFrame) -> Styler:
    """The limits table for a notebook, its verdict in full (the column the table exists for)."""
    return _readable(shown, LIMIT_COLUMNS, 24)


# the open-loop rates, as the notebook shows them: source column -> (header, decimals; None: text in full)
RATE_COLUMNS: dict[str, tuple[str, int | None]] = {
    "rate": ("requests/s asked", 2),
    "offered_rate": ("offered", 2),
    "achieved_rate": ("completed", 2),
    "output_throughput": ("output tok/s", 0),
    "ttft_p50_ms": ("TTFT p50, ms", 1),
    "ttft_p99_ms": ("TTFT p99, ms", 1),
    "tpot_p50_ms": ("TPOT p50, ms", 2),
    "e2el_p99_ms": ("E2EL p99, ms", 0),
    "client_lag_p99_ms": ("client lag p99, ms", 0),
    "tpot_clock_gap_pct": ("TPOT, client against vLLM, %", 0),
    "goodput": ("goodput, requests/s", 2),
    "running_peak": ("running (peak)", 0),
    "waiting_peak": ("waiting (peak)", 0),
    "verdict": ("verdict", None),
}


def rates_style(rates: pd.DataFrame) -> Styler:
    """The open-loop levels under readable headers, numbers rounded, the verdict in full and left-aligned."""
    shown = rates[[c for c in RATE_COLUMNS if c in rates]].rename(columns={c: h for c, (h, _) in RATE_COLUMNS.items()})
    return _readable(shown, RATE_COLUMNS, 28).hide(axis="index")


# the client's clock against vLLM's own, as the notebook shows it (metrics.EngineClock)
CLOCK_COLUMNS: dict[str, tuple[str, int]] = {
    "concurrency": ("streams", 0),
    "client_ttft_mean_ms": ("TTFT mean, client, ms", 1),
    "vllm_ttft_mean_ms": ("TTFT mean, vLLM, ms", 1),
    "outside_ms": ("of it outside vLLM's clock, ms", 1),
    "client_tpot_mean_ms": ("TPOT mean, client, ms", 2),
    "vllm_tpot_mean_ms": ("TPOT mean, vLLM, ms", 2),
    "tpot_clock_gap_pct": ("TPOT, client against vLLM, %", 0),
    "window_requests": ("requests, client", 0),
    "vllm_requests": ("requests, vLLM", 0),
}


def clock_table(table: pd.DataFrame) -> pd.DataFrame:
    """Each level's mean TTFT and TPOT by the client's clock and by vLLM's, over the same requests (medians of
    the repeats); empty when the server's /metrics had no latency histograms."""
    if "vllm_tpot_mean_ms" not in table or table["vllm_tpot_mean_ms"].isna().all():
        return pd.DataFrame()
    table = table.copy()
    table["outside_ms"] = table["client_ttft_mean_ms"] - table["vllm_ttft_mean_ms"]
    shown = table[list(CLOCK_COLUMNS)].copy()
    for column, (_, decimals) in CLOCK_COLUMNS.items():
        shown[column] = shown[column].round().astype("Int64") if decimals == 0 else shown[column].round(decimals)
    return shown.rename(columns={c: header for c, (header, _) in CLOCK_COLUMNS.items()}).set_index("streams")


def workload_of(path: str | Path) -> tuple[float, float] | None:
    """Prompt and output tokens per request of a run: its workload for a servebook run, the tokens it sent and got
    for `vllm bench serve` results; None when it cannot be told (a dataset, an unreadable file)."""
    path = Path(path)
    try:
        if path.is_dir() and (record := results.read(path, BenchmarkRecord)):
            return None if record.dataset else (record.workload.input_len, record.workload.output_len)
        files = [path] if path.is_file() else sorted(path.glob("*.json"))
        done = [vllm_format.read(f) for f in files]
    except (ServebookError, ValueError, OSError):
        return None
    completed = sum(r.get("completed") or 0 for r in done)
    if not completed:
        return None
    return (
        sum(r.get("total_input_tokens") or 0 for r in done) / completed,
        sum(r.get("total_output_tokens") or 0 for r in done) / completed,
    )


def load_run(path: str | Path) -> tuple[str, pd.DataFrame]:
    """A run's per-level table and its label: a servebook run folder (labelled with the layout its launch record
    names), a result file of ``vllm bench serve --save-result``, or a folder of such files (one per
    concurrency)."""
    path = Path(path)
    if path.is_file():
        return f"{path.stem} (vllm bench serve)", vllm_format.levels([vllm_format.read(path)])
    try:
        record = results.read(path, BenchmarkRecord) if path.is_dir() else None
    except (ValueError, UnicodeDecodeError) as exc:  # pydantic's ValidationError is a ValueError
        table = path / f"{BenchmarkRecord.FILE}_levels.csv"
        if table.is_file():  # a record of an older servebook: its levels table holds what a comparison reads
            return f"{_layout_of(path)}{path.name}, levels table", pd.read_csv(table)
        raise ServebookError(
            f"{path / (BenchmarkRecord.FILE + '.json')}: not a benchmark record servebook can read "
            f"({str(exc).splitlines()[0]}); it is cut or from another tool: pass run folders `servebook run` wrote"
        ) from None
    if record is None:
        if not path.exists():
            raise ServebookError(f"{path}: no such file or folder; pass run folders or `vllm bench serve` result files")
        if (path / "manifest.json").is_file():
            raise ServebookError(f"{path}: {_run_without_benchmark(path)}; pass runs that measured a sweep")
        found = sorted(path.glob("*.json")) if path.is_dir() else []
        if not found:
            raise ServebookError(
                f"{path} holds no {BenchmarkRecord.FILE}.json and no `vllm bench serve` result: pass folders that "
                "`servebook run` or `servebook bench` wrote, or files `vllm bench serve --save-result` wrote"
            )
        return f"{path.name} (vllm bench serve)", vllm_format.levels([vllm_format.read(f) for f in found])
    launch = results.read(path, LaunchRecord)
    label = f"{launch.layout.name} ({path.name})" if launch else path.name
    return label, levels(record)


def _run_without_benchmark(path: Path) -> str:
    """What a servebook run folder with no benchmark record ran instead, from its manifest."""
    try:
        manifest = results.Manifest.model_validate_json((path / "manifest.json").read_text())
    except (ValueError, OSError):
        return f"a servebook run folder without {BenchmarkRecord.FILE}.json"
    ran = ", ".join(f"{s.name} {s.status}" for s in manifest.stages) or "no stage"
    return f"a servebook run without a benchmark ({manifest.status}: {ran})"


def _layout_of(path: Path) -> str:
    try:
        launch = results.read(path, LaunchRecord)
    except (ValueError, UnicodeDecodeError):
        return ""
    return f"{launch.layout.name}: " if launch else ""


def replica_table(levels: list[Level]) -> pd.DataFrame:
    """Per level and replica: its share of the finished requests and its prefix-cache hit rate, in percent."""
    rows = [
        {
            "streams": level.concurrency,
            "replica": url,
            "share of requests, %": round(100 * share, 1),
            "prefix-cache hit rate, %": (
                round(100 * rate, 1) if (rate := level.replica_prefix_hit_rates.get(url)) is not None else None
            ),
            "answered": "no: stopped during the level" if url in level.dead_replicas else "yes",
            "router retries (level)": level.router_retries,
            "lost (level)": level.failed,
        }
        for level in levels
        for url, share in sorted(level.replica_shares.items())
    ]
    return pd.DataFrame(rows)
