"""``servebook``: the pipeline and each stage's library from a terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from servebook.errors import ServebookError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def _fail(exc: ServebookError) -> None:
    typer.echo(f"servebook: {exc}", err=True)
    raise typer.Exit(exc.exit_code)


@app.command()
def run(
    params_file: Path = typer.Argument(..., help="params YAML, e.g. params/default.yaml"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE (repeatable)"),
    stages: Optional[str] = typer.Option(None, help="comma-separated stages to run, e.g. reconnaissance,launch"),
) -> None:
    """Run the stage notebooks into a new outputs/<timestamp>-<run_name>/ folder."""
    from servebook import params

    try:
        params.load(params_file, set_)  # in a fraction of a second, before papermill and vLLM are imported
        from servebook import runner

        run_dir, code = runner.run(params_file, set_, stages)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(str(run_dir))
    raise typer.Exit(code)


@app.command()
def prepare(
    params_file: Path = typer.Argument(..., help="params YAML"),
    out: Path = typer.Option(..., help="folder for the parameterized notebooks"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE (repeatable)"),
    run_dir: Optional[Path] = typer.Option(None, help="run folder the notebooks write results into"),
) -> None:
    """Write parameterized copies of the stage notebooks without running them (for nbval)."""
    from servebook import runner

    try:
        for path in runner.prepare(params_file, out, set_, run_dir):
            typer.echo(str(path))
    except ServebookError as exc:
        _fail(exc)


@app.command()
def check(params_file: Path = typer.Argument(..., help="params YAML to validate")) -> None:
    """Validate a params file without running anything."""
    from servebook import params

    try:
        p = params.load(params_file)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(f"{params_file}: ok ({len(p.model_fields_set)} parameters set, world size {p.world_size})")


@app.command("params")
def list_params() -> None:
    """List every parameter of the shared vocabulary with its default."""
    from servebook.params import Params

    for name, f in Params.model_fields.items():
        default = f.get_default(call_default_factory=True)
        typer.echo(f"{name:24} {default!r:32} {f.description or ''}")


@app.command()
def gpus(as_json: bool = typer.Option(False, "--json", help="print the full inventory as JSON")) -> None:
    """Print the GPU inventory: memory, processes, links, topology."""
    from servebook import hardware, recon

    inv = hardware.inventory()
    if as_json:
        typer.echo(json.dumps(inv.to_dict(), indent=2))
        return
    if not inv.available:
        typer.echo(f"no GPUs: {inv.error}")
        return
    typer.echo(f"driver {inv.driver_version}, CUDA {inv.cuda_driver_version}, {len(inv.gpus)} GPU(s)")
    results = {"inventory": inv.to_dict()}
    typer.echo(recon.gpu_table(results).to_string(index=False))
    if inv.pairs:
        typer.echo("\ntopology (NVML common ancestor):")
        typer.echo(recon.pair_matrix(results, "topology").to_string())
        typer.echo("\nNVLink P2P:")
        typer.echo(recon.pair_matrix(results, "p2p_nvlink").to_string())


@app.command("build-model")
def build_model(
    force: bool = typer.Option(False, help="rebuild even when cached"),
    quiet: bool = typer.Option(False, help="print only the path"),
) -> None:
    """Build (or find cached) the embedded tiny Qwen3-MoE checkpoint."""
    import time

    from servebook import models

    start = time.monotonic()
    existed = (models.tiny_model_dir() / "servebook-build.json").is_file()
    path = models.build_tiny_model(force=force)
    if not quiet:
        typer.echo(f"{'reused' if existed and not force else 'built'} in {time.monotonic() - start:.1f} s")
    typer.echo(str(path))


def _server_config(params_file: Path, set_: list[str]):
    from servebook import params, recon, hardware, server

    p = params.load(params_file, set_)
    device = recon.resolve_device(p.device, hardware.inventory())
    return p, server.ServerConfig.from_params(p.model_dump(), device)


@app.command()
def launch(
    params_file: Path = typer.Argument(..., help="params YAML"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
    log_dir: Path = typer.Option(None, help="where the server log goes (default outputs/servers)"),
) -> None:
    """Start a vLLM server (or reuse a matching healthy one) and wait until it is ready."""
    from servebook import server
    from servebook.results import outputs_root

    try:
        p, cfg = _server_config(params_file, set_)
        result = server.launch(cfg, log_dir or outputs_root() / "servers", stop_leftovers=p.stop_leftovers,
                               on_progress=lambda msg, t: typer.echo(f"[{t:6.1f} s] {msg}"), log=typer.echo)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(f"{'reused' if result.reused else 'ready'}: {result.url} (pid {result.pid}, log {result.log_path})")


@app.command()
def download(
    params_file: Path = typer.Argument(..., help="params YAML (model, model_store, download_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Fetch the checkpoint with a disk preflight, progress and resume, then verify every file."""
    from servebook import download_stage, params, runner

    try:
        p = params.load(params_file, set_)
        run_dir = runner.new_run_dir(f"{p.run_name}-download")
        try:
            got = download_stage.run(p, run_dir)
        except ServebookError:
            run_dir.rmdir() if not any(run_dir.iterdir()) else None
            raise
        fetched = got["fetch"] or {}
        typer.echo(f"{got['local_path']}: fetched {len(fetched.get('fetched_files', []))} files, "
                   f"{len(fetched.get('skipped_files', []))} already complete; verification "
                   f"{'passed' if got['verification']['ok'] else 'FAILED'}")
        download_stage.raise_on_failure(got)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(str(run_dir))


@app.command()
def plan(
    model: str = typer.Argument(..., help="checkpoint folder, config.json, hub repo id, or builtin:tiny-qwen3-moe"),
    gpus_: int = typer.Option(8, "--gpus", help="number of GPUs"),
    gpu: str = typer.Option("H200", help="GPU model: " + ", ".join(["H200", "H100-SXM", "H100-PCIe", "B200", "A100-80GB",
                                                                    "L40S", "RTX-PRO-6000"])),
    max_model_len: int = typer.Option(4096, help="context length each request may reach"),
    gpu_memory_utilization: float = typer.Option(0.92, help="share of GPU memory vLLM may use"),
    kv_cache_dtype: str = typer.Option("auto", help="auto or fp8"),
    batch: int = typer.Option(64, help="concurrent sequences for the throughput ranking"),
    as_json: bool = typer.Option(False, "--json", help="print the whole plan as JSON"),
) -> None:
    """Which TP/PP/DP/EP layouts vLLM accepts for a model on N GPUs, memory per GPU, KV tokens, a recommendation."""
    from servebook import gpus as gpu_table, modelspec, planner

    try:
        spec = modelspec.load(model)
        g = gpu_table.lookup(gpu)
        device = planner.Device(g.name, gpus_, g.memory_bytes, g.bandwidth_bytes_s,
                                collective_latency_s=30e-6 if "NVLink" in g.interconnect else 45e-6, source=g.source)
        result = planner.plan(spec, device, max_model_len, gpu_memory_utilization, kv_cache_dtype, batch=batch)
    except KeyError as exc:
        typer.echo(f"servebook: {exc.args[0]}", err=True)
        raise typer.Exit(2)
    except (ServebookError, ValueError) as exc:
        typer.echo(f"servebook: {exc}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    from servebook import plan_stage

    typer.echo(f"{spec.architecture} on {gpus_} x {g.name}; weights {result['weights_total_bytes'] / 1e9:,.1f} GB")
    typer.echo(plan_stage.table(result).drop(columns=["why not"]).to_string(index=False))
    for l in result["layouts"]:
        if l["reasons"]:
            typer.echo(f"{l['name']}: {l['reasons'][0]}")
    typer.echo(f"recommended: {result['why']}")
    if result["recommended"]:
        typer.echo("  " + " ".join(result["recommended"]["flags"]))


@app.command()
def bench(
    params_file: Path = typer.Argument(..., help="params YAML (server and bench_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Launch (or reuse) the server, sweep concurrency to saturation, write tables to a new run folder."""
    from servebook import bench_stage

    def report(data: dict) -> None:
        typer.echo(f"stopped: {data['stop_reason']}")
        if data["best"]:
            typer.echo(f"best {data['best']['output_throughput']:.0f} output tok/s at concurrency "
                       f"{data['best']['concurrency']}, plateau from {data['plateau_concurrency']}")
        bench_stage.raise_on_fault(data)

    _stage_with_server(params_file, set_, "bench", bench_stage.run, report)


def _stage_with_server(params_file: Path, overrides: list[str], suffix: str, stage, report) -> None:
    """Launch (or reuse) the configured server in a new run folder, run one stage against it, and stop the
    server afterwards if this command started it (unless keep_server)."""
    from servebook import launch_stage, params, runner

    try:
        p = params.load(params_file, overrides)
        run_dir = runner.new_run_dir(f"{p.run_name}-{suffix}")
        launch_stage.run(p, run_dir)
        try:
            data = stage(p, run_dir)
        finally:
            if not p.keep_server:
                runner.stop_started_server(run_dir, typer.echo)
        report(data)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(str(run_dir))


@app.command()
def deploy(
    params_file: Path = typer.Argument(..., help="params YAML (the server, deploy_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Launch (or reuse) the configured server, render and verify its systemd unit, prove the pre-start and
    post-start commands, and install it only when deploy_install is true."""
    from servebook import deploy_stage

    def report(data: dict) -> None:
        typer.echo(f"unit: {data['unit_file']} (TimeoutStartSec={data['timeout_start_s']}, load {data['load_seconds']:.0f} s "
                   f"{data['load_source']}); systemd-analyze verify {'passed' if data['verify']['ok'] else 'FAILED'}")
        deploy_stage.raise_on_failure(data)

    _stage_with_server(params_file, set_, "deploy", deploy_stage.run, report)


@app.command()
def compare(
    run_dirs: List[Path] = typer.Argument(..., help="two or more run folders with 05_benchmark_levels.parquet"),
    html: Optional[Path] = typer.Option(None, help="also write the figure to this HTML file"),
) -> None:
    """Compare benchmark runs on shared axes and report where one overtakes another."""
    from servebook import plots

    fig, crossings = plots.compare(run_dirs)
    for c in crossings:
        where = f"crosses over at concurrency {c['crossover_concurrency']}" if c["crossover_concurrency"] else "never cross"
        typer.echo(f"{c['a']} vs {c['b']}: {where}")
    if html:
        fig.write_html(html, include_plotlyjs=True)
        typer.echo(str(html))


@app.command()
def status(as_json: bool = typer.Option(False, "--json")) -> None:
    """List servers servebook launched, their health, and orphaned vLLM processes."""
    from servebook import server

    rows = server.status()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no servebook servers and no orphaned vLLM processes")
    for r in rows:
        typer.echo(f"port {r['port']}  pid {r['pid']}  {r['health']:8}  processes {r['processes']}  {r['model']}  {r['log']}")


@app.command()
def stop(
    port: Optional[int] = typer.Option(None, help="stop the server on this port (default: every servebook server)"),
    orphans: Optional[bool] = typer.Option(None, help="also stop orphaned VLLM:: processes left by earlier crashes "
                                           "(default: yes without --port, no with it)"),
) -> None:
    """Stop servers (SIGTERM, grace, SIGKILL on the whole group) and verify nothing is left."""
    from servebook import server

    try:
        outcome = server.stop(port=port, orphans=port is None if orphans is None else orphans)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(outcome["summary"])


@app.command("gpu-check")
def gpu_check(
    port: int = typer.Option(..., help="the port the server will listen on"),
    gpus_: Optional[str] = typer.Option(None, "--gpus", help="comma-separated physical GPU indices the server will use"),
    host: str = typer.Option("127.0.0.1"),
) -> None:
    """Exit non-zero, listing the holders, if anything holds the GPUs or the port (a service's ExecStartPre)."""
    from servebook import server

    ids = [int(x) for x in gpus_.split(",")] if gpus_ else None
    problems = server.resources_held(port, host, ids)
    for line in problems:
        typer.echo(f"servebook gpu-check: {line}", err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"free: port {port}" + (f", GPUs {gpus_}" if gpus_ else ""))


@app.command("wait-ready")
def wait_ready(
    url: str = typer.Option(..., help="server base URL, e.g. http://127.0.0.1:8000"),
    timeout: float = typer.Option(3600, help="seconds to wait before giving up"),
    poll: float = typer.Option(2.0, help="seconds between /health requests"),
) -> None:
    """Wait until /health answers 200 (a service's ExecStartPost); non-zero on 503 or timeout."""
    from servebook import server

    ok, message, _ = server.wait_ready(url, timeout, poll)
    typer.echo(message, err=not ok)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
