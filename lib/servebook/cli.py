"""servebook: the pipeline and each stage's library from a terminal."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, NoReturn

import typer

from servebook.errors import ServebookError
from servebook.gpus import GPUS

if TYPE_CHECKING:
    from servebook.records import PlanRecord

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)


def _fail(exc: ServebookError, code: int | None = None) -> NoReturn:
    typer.echo(f"servebook: {exc}", err=True)
    raise typer.Exit(exc.exit_code if code is None else code)


def _version(value: bool) -> None:
    if value:
        from servebook import environment

        typer.echo(f"servebook {environment.package_version('servebook')}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """servebook: the pipeline and each stage from a terminal."""


@app.command()
def run(
    params_file: Path = typer.Argument(..., help="params YAML, e.g. params/default.yaml"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE (repeatable)"),
    stages: str | None = typer.Option(
        None, help="comma-separated stages to run, by name (launch) or number (03); an unknown one lists them all"
    ),
) -> None:
    """Run the stage notebooks into a new outputs/<timestamp>-<run_name>/ folder."""
    _run_stages(params_file, set_, stages)


def _run_stages(params_file: Path, overrides: list[str], stages: str | None, suffix: str = "") -> NoReturn:
    from servebook import params

    try:
        params.load(params_file, overrides)  # in a fraction of a second, before papermill and vLLM are imported
        from servebook import runner

        run_dir, code = runner.run(params_file, overrides, stages, suffix=suffix)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(str(run_dir))
    raise typer.Exit(code)


@app.command()
def prepare(
    params_file: Path = typer.Argument(..., help="params YAML"),
    out: Path = typer.Option(..., help="folder for the parameterized notebooks"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE (repeatable)"),
    run_dir: Path | None = typer.Option(None, help="run folder the notebooks write results into"),
) -> None:
    """Write parameterized copies of the stage notebooks without running them (for nbval)."""
    from servebook import runner

    try:
        for path in runner.prepare(params_file, out, set_, run_dir):
            typer.echo(str(path))
    except ServebookError as exc:
        _fail(exc)


@app.command()
def check(
    params_file: Path = typer.Argument(..., help="params YAML to validate"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE (repeatable)"),
) -> None:
    """Every check that costs no load: the whole file, vLLM's parser on the serving command, flags set twice, the
    dataset against max_model_len. Nothing starts."""
    from servebook import checks, params
    from servebook.errors import ParamsError

    try:
        p = params.load(params_file, set_)
        found = checks.problems(p)
        if found:
            raise ParamsError(str(params_file), found)
    except ServebookError as exc:
        _fail(exc, code=2)
    typer.echo(f"{params_file}: ok ({len(p.model_fields_set)} parameters set: {checks.where(p)})")


@app.command("params")
def list_params() -> None:
    """List every parameter of the shared vocabulary: type, default and meaning."""
    from servebook.params import FIELDS, parameter_line

    for name in FIELDS:
        typer.echo(parameter_line(name))


@app.command()
def gpus(as_json: bool = typer.Option(False, "--json", help="print the full inventory as JSON")) -> None:
    """Print the GPU inventory: memory, processes, links, topology."""
    from servebook import hardware
    from servebook.stages.reconnaissance import gpu_table, pair_matrix

    inv = hardware.inventory()
    if as_json:
        typer.echo(json.dumps(inv.to_dict(), indent=2))
        return
    if not inv.available:
        typer.echo(f"no GPUs: {inv.error}")
        return
    typer.echo(f"driver {inv.driver_version}, CUDA {inv.cuda_driver_version}, {len(inv.gpus)} GPU(s)")
    typer.echo(gpu_table(inv).to_string(index=False))
    if inv.pairs:
        typer.echo("\ntopology (NVML common ancestor):")
        typer.echo(pair_matrix(inv, "topology").to_string())
        typer.echo("\nNVLink P2P:")
        typer.echo(pair_matrix(inv, "p2p_nvlink").to_string())


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


@app.command()
def launch(
    params_file: Path = typer.Argument(..., help="params YAML"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
    log_dir: Path = typer.Option(None, help="where the server log goes (default outputs/servers)"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="start the exact command with --load-format dummy, report KV and the timeline, stop"
    ),
) -> None:
    """Start the server the params describe, in its shape (one server, one across nodes, replicas behind a
    router), or reuse a matching healthy one, and wait until it is ready; each start-up phase is printed as it
    ends, the timeline when it is ready."""
    from servebook import checks, hardware, params, server, startplan, topology
    from servebook.errors import ParamsError
    from servebook.results import outputs_root
    from servebook.stages import launch as launch_stage

    try:
        p = params.load(params_file, set_)
        cfg = server.ServerConfig.from_params(p, hardware.resolve_device(p.device, hardware.inventory()))
        cfg = startplan.with_load_choice(cfg, launch_stage.load_choice_for(p, cfg, None))
        launch_stage.check_load_options(cfg)
        if refused := checks.plan_problems(p, cfg):  # the gate `servebook run` applies through its plan stage
            raise ParamsError(str(params_file), refused)
        if dry_run:
            cfg = cfg.dry()
        shape = topology.of(p, cfg, log_dir or outputs_root() / "servers")
        typer.echo(f"launching {shape.describe()}")
        result = shape.start().launch
    except ServebookError as exc:
        _fail(exc)
    typer.echo(f"{'reused' if result.reused else 'ready'}: {result.url} (pid {result.pid}, log {result.log_path})")
    if result.timeline:
        typer.echo(f"{result.timeline.summary()}\nslowest: {result.timeline.slowest} — {result.timeline.slowest_fix}")
    if dry_run:
        kv = result.values.kv_cache_tokens
        typer.echo(f"dry start: KV cache {kv or 0:,} tokens, weights {result.values.model_memory_gib} GiB; stopping it")
        shape.stop()


@app.command()
def download(
    params_file: Path = typer.Argument(..., help="params YAML (model, model_store, download_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Fetch the checkpoint with a disk preflight, progress and resume, then verify every file (stage 02 alone)."""
    _run_stages(params_file, set_, "download", suffix="download")


@app.command()
def rehearse(
    params_file: Path = typer.Argument(..., help="params YAML (the server, rehearse_* and bench_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Start every candidate (the plan's best layouts, each as set and with every rehearse_variants setting) on
    dummy weights, sweep it briefly, stop it, and rank them by measurement (reconnaissance, plan, then stage 02
    rehearse); nothing of the checkpoint's weights is read."""
    _run_stages(params_file, set_, "reconnaissance,plan,rehearse", suffix="rehearse")


def _vocabulary_default(name: str) -> Any:
    from servebook.params import Params

    return Params.model_fields[name].get_default(call_default_factory=True)


@app.command()
def plan(  # noqa: PLR0913, PLR0917  (a Typer command: one parameter per option)
    model: str = typer.Argument(..., help="checkpoint folder, config.json, hub repo id, or builtin:tiny-qwen3-moe"),
    gpus_: int = typer.Option(8, "--gpus", min=1, help="number of GPUs (per node with --nodes)"),
    gpu: str = typer.Option("H200", help="GPU model: " + ", ".join(GPUS)),
    max_model_len: int = typer.Option(
        _vocabulary_default("max_model_len"), help="context length each request may reach"
    ),
    gpu_memory_utilization: float = typer.Option(
        _vocabulary_default("gpu_memory_utilization"), help="share of GPU memory vLLM may use (vLLM's default)"
    ),
    kv_cache_dtype: str = typer.Option(_vocabulary_default("kv_cache_dtype"), help="auto or fp8"),
    batch: int = typer.Option(
        _vocabulary_default("plan_batch"), help="concurrent sequences for the throughput ranking"
    ),
    input_len: int = typer.Option(
        _vocabulary_default("bench_input_len"), min=1, help="prompt tokens per request, for the forecast"
    ),
    output_len: int = typer.Option(
        _vocabulary_default("bench_output_len"), min=2, help="output tokens per request, for the forecast"
    ),
    nodes: int = typer.Option(1, min=1, help="machines the server spans (then --gpus counts GPUs per node)"),
    interconnect: str = typer.Option(
        "", help="network between the nodes, e.g. '8x400Gb/s InfiniBand' or '100GbE' (needed with --nodes)"
    ),
    max_num_seqs: int = typer.Option(0, min=0, help="sequences per engine (CUDA-graph captures, sampler); 0: vLLM's"),
    max_num_batched_tokens: int = typer.Option(0, min=0, help="tokens per step (the profile run's size); 0: vLLM's"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="no torch.compile and no CUDA graphs"),
    vllm_version: str = typer.Option(
        "", help="the vLLM the GPUs will run (its defaults size the plan, e.g. 0.25); empty: the one installed here"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the whole plan as JSON, with each node's command"),
    wide: bool = typer.Option(False, "--wide", help="every column of the table (about 300 characters wide)"),
) -> None:
    """Which TP/PP/DP/EP layouts vLLM accepts for a model on N GPUs, memory per GPU, KV tokens, a recommendation.

    A terminal answer; `servebook run PARAMS --stages reconnaissance,plan` writes it as a run folder with a report.
    """
    from servebook import gpus as gpu_specs
    from servebook import params, planner
    from servebook.stages.plan import make_plan

    if model.endswith((".yaml", ".yml")):
        _fail(
            ServebookError(
                f"plan takes a model (a checkpoint folder, config.json or hub repo id), not the params file {model}; "
                f"for a params file: servebook run {model} --stages reconnaissance,plan"
            )
        )

    try:
        if nodes > 1 and not interconnect:
            raise ServebookError(
                f"--nodes {nodes} needs --interconnect, the network between the nodes "
                "(e.g. --interconnect '8x400Gb/s InfiniBand'): the ranking charges what crosses it"
            )
        if vllm_version and not re.fullmatch(params.VLLM_VERSION, vllm_version):
            raise ServebookError(
                f"--vllm-version {vllm_version!r} is not a version number: give the one the GPUs will run, "
                "e.g. --vllm-version 0.25 (or 0.25.0)"
            )
        p = params.validate(
            {"model": model, "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
             "kv_cache_dtype": kv_cache_dtype, "plan_batch": batch, "nodes": nodes, "node_interconnect": interconnect,
             "device": "cuda", "plan_gpu": gpu, "plan_gpu_count": gpus_ * nodes, "layout_from_plan": True,
             "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
             "enforce_eager": enforce_eager, "bench_input_len": input_len, "bench_output_len": output_len,
             "plan_vllm_version": vllm_version},
            source="servebook plan",
        )  # fmt: skip
        link = planner.parse_interconnect(interconnect) if nodes > 1 else None
        g = gpu_specs.lookup(gpu)
        result = make_plan(p, planner.Device.for_gpu(g, gpus_ * nodes, nodes=nodes, link=link))
    except ServebookError as exc:
        _fail(exc, code=2)
    if as_json:
        typer.echo(result.model_dump_json(indent=2, exclude={"schema_version", "written_at"}))
        return
    where = f"{nodes} nodes of {gpus_} x {g.name} ({interconnect})" if nodes > 1 else f"{gpus_} x {g.name}"
    _echo_plan(result, where, wide, version_named=bool(vllm_version))


def _echo_plan(result: PlanRecord, where: str, wide: bool, version_named: bool) -> None:
    """`servebook plan`'s terminal answer: the table, each refusal, the recommendation, the bands, the command."""
    from servebook.stages.plan import bands_text, defaults_text, node_commands_text, table, terminal_table

    typer.echo(f"{result.model.architecture} on {where}; weights {result.weights_total_bytes / 1e9:,.1f} GB")
    shown = table(result).drop(columns=["why not"]) if wide else terminal_table(result)
    typer.echo(shown.to_string(index=False))
    for layout in result.layouts:
        if layout.reasons:
            typer.echo(f"{layout.name}: {layout.reasons[0]}")
    typer.echo(f"recommended: {result.why}")
    typer.echo(
        defaults_text(result)
        + ("" if version_named else " (the vLLM installed here; --vllm-version names the one the GPUs will run)")
    )
    if bands := bands_text(result):
        typer.echo(bands)
    best = result.recommended
    for warning in best.warnings if best and result.device.nodes > 1 else []:
        typer.echo(f"  note: {warning}")
    if result.node_commands:
        typer.echo("  " + node_commands_text(result).replace("\n", "\n  "))


@app.command()
def bench(
    params_file: Path = typer.Argument(..., help="params YAML (server and bench_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Launch (or reuse) the server and sweep concurrency to saturation, into a new run folder with its report."""
    _run_stages(params_file, set_, "launch,benchmark", suffix="bench")


@app.command()
def deploy(
    params_file: Path = typer.Argument(..., help="params YAML (the server, deploy_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
) -> None:
    """Launch (or reuse) the configured server, render and verify its systemd unit, prove the pre-start and
    post-start commands, and install it only when deploy_install is true."""
    _run_stages(params_file, set_, "launch,deploy", suffix="deploy")


export_app = typer.Typer(no_args_is_help=True, help="Render what a plan would run somewhere else.")
app.add_typer(export_app, name="export")


@export_app.command("k8s")
def export_k8s(
    params_file: Path = typer.Argument(..., help="params YAML (the server, nodes, plan_gpu, k8s_* parameters)"),
    set_: List[str] = typer.Option([], "--set", help="override one parameter: KEY=VALUE"),
    out: Path = typer.Option(None, "--out", help="folder for the manifests; default outputs/<run_name>-k8s"),
    model_config: str = typer.Option("", "--model-config", help="a config.json to plan from without the Hub"),
    validate: bool = typer.Option(True, help="check every object against the Kubernetes and LWS schemas"),
) -> None:
    """A LeaderWorkerSet and a Service (and vllm-router for several replicas) that run the plan's launch on a
    Kubernetes cluster: the same vLLM flags, bound to the variables LWS gives each pod."""
    from servebook import k8s, params, topology

    try:
        p = params.load(params_file, set_)
        manifests = topology.export_k8s(p, model_config)
        problems = k8s.validate(manifests) if validate else []
    except ServebookError as exc:
        _fail(exc, code=2)
    folder = out or Path("outputs") / f"{p.run_name}-k8s"
    if folder.exists() and any(folder.iterdir()):
        _fail(ServebookError(f"--out {folder} is not empty; name a new folder (nothing was overwritten)"), code=2)
    for path in manifests.write(folder):
        typer.echo(f"wrote {path}")
    for note in manifests.notes:
        typer.echo(f"  {note}")
    if problems:
        for problem in problems:
            typer.echo(f"invalid: {problem}", err=True)
        raise typer.Exit(1)
    if validate:
        typer.echo(f"valid: {len(manifests.objects())} objects against Kubernetes {k8s.KUBERNETES_VERSION} and LWS v1")


@app.command()
def compare(
    run_dirs: List[Path] = typer.Argument(
        ...,
        help="two or more runs: servebook run folders, `vllm bench serve --save-result` files, or folders of them",
    ),
    html: Path | None = typer.Option(None, help="also write the figure to this HTML file"),
) -> None:
    """Compare benchmark runs on shared axes and report where one overtakes another."""
    from servebook import plots
    from servebook.stages.benchmark import load_run

    if len(run_dirs) < 2:
        _fail(
            ServebookError(
                f"compare needs two or more runs, got {len(run_dirs)}; "
                "e.g. servebook compare outputs/RUN_A outputs/RUN_B vllm-bench-results/"
            )
        )
    try:
        runs = [load_run(d) for d in run_dirs]
    except ServebookError as exc:
        _fail(exc)
    from servebook.stages.benchmark import workload_of

    fig, crossings = plots.compare(runs)
    if warning := plots.workload_warning({label: workload_of(d) for (label, _), d in zip(runs, run_dirs)}):
        typer.echo(f"warning: {warning}", err=True)
    for c in crossings:
        where = f"crosses over at concurrency {c.crossover_concurrency}" if c.crossover_concurrency else "never cross"
        typer.echo(f"{c.a} vs {c.b}: {where}")
    if html:
        fig.write_html(html, include_plotlyjs=True)
        typer.echo(str(html))


@app.command()
def lab(
    port: int = typer.Option(8888, help="the port JupyterLab listens on (127.0.0.1 only)"),
    prepare_only: bool = typer.Option(False, "--prepare-only", help="make the working copy, print the command"),
) -> None:
    """JupyterLab on your own copy of the notebooks (workbook/, ignored by git): what you run, type and save there
    never changes the project's notebooks/. A copy is made for each notebook you do not have yet; yours are kept."""
    from servebook import lab as lab_mod

    if not 1 <= port <= 65535:
        _fail(ServebookError(f"--port {port} is no TCP port: give one from 1 to 65535, e.g. --port 8888"), code=2)
    work, copied, newer = lab_mod.prepare_workbook()
    typer.echo(f"working copy: {work}" + (f" (copied now: {', '.join(copied)})" if copied else ""))
    for name in newer:
        typer.echo(
            f"  notebooks/{name} changed since your copy was made; delete workbook/{name} to start again from it"
        )
    command = lab_mod.lab_command(work, port)
    typer.echo(f"on a remote GPU box, from your laptop: ssh -N -L {port}:127.0.0.1:{port} you@this-machine")
    if prepare_only:
        typer.echo(" ".join(command))
        return
    os.execv(command[0], command)


@app.command()
def status(as_json: bool = typer.Option(False, "--json")) -> None:
    """List servers servebook launched, their health, and orphaned vLLM processes."""
    from servebook import server

    rows = server.status()
    if as_json:
        typer.echo(json.dumps([r.model_dump() for r in rows], indent=2))
        return
    if not rows:
        typer.echo("no servebook servers and no orphaned vLLM processes")
    for r in rows:
        typer.echo(
            f"port {r.port}  pid {r.pid}  {r.health:8}  processes {r.processes}  {r.model}  {r.log}"
            + (f"\n    {r.detail}" if r.detail else "")
        )


@app.command()
def stop(
    params_file: Path | None = typer.Argument(None, help="params YAML: stop the server it launches (its port)"),
    port: int | None = typer.Option(None, help="stop the server on this port (default: every servebook server)"),
    orphans: bool | None = typer.Option(
        None,
        help="also stop orphaned VLLM:: processes left by earlier crashes "
        "(default: yes without --port or PARAMS, no with one)",
    ),
) -> None:
    """Stop servers (SIGTERM, grace, SIGKILL on the whole group) and verify nothing is left."""
    from servebook import params, server

    try:
        if params_file is not None:
            if port is not None:
                _fail(ServebookError("give a params file or --port, not both"))
            port = params.load(params_file).port
        outcome = server.stop(port=port, orphans=port is None if orphans is None else orphans)
    except ServebookError as exc:
        _fail(exc)
    typer.echo(outcome.summary)


@app.command("gpu-check")
def gpu_check(
    port: int = typer.Option(..., help="the port the server will listen on"),
    gpus_: str | None = typer.Option(None, "--gpus", help="comma-separated physical GPU indices the server will use"),
    host: str = typer.Option("127.0.0.1"),
) -> None:
    """Exit non-zero, listing the holders, if anything holds the GPUs or the port (a service's ExecStartPre)."""
    from servebook import server

    try:
        ids = [int(x) for x in gpus_.split(",")] if gpus_ else None
    except ValueError:
        _fail(ServebookError(f"--gpus {gpus_!r}: list GPU indices as numbers, e.g. --gpus 0,1"), code=2)
    problems = server.resources_held(port, host, ids)
    for line in problems:
        typer.echo(f"servebook gpu-check: {line}", err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"free: port {port}" + (f", GPUs {gpus_}" if gpus_ else ""))


@app.command("ray-wait")
def ray_wait(
    address: str = typer.Option(..., help="the Ray head's HOST:PORT, e.g. 10.0.0.1:6379"),
    nodes: int = typer.Option(..., min=1, help="how many nodes must be alive"),
    timeout: float = typer.Option(600, help="seconds to wait before giving up"),
) -> None:
    """Wait until a Ray cluster counts every node alive (the head's unit runs it before vLLM); non-zero on timeout."""
    from servebook import raycluster

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        _fail(ServebookError(f"--address {address!r}: give the Ray head as HOST:PORT, e.g. 10.0.0.1:6379"), code=2)
    ok, message = raycluster.wait_alive(address, nodes, timeout)
    typer.echo(message, err=not ok)
    raise typer.Exit(0 if ok else 1)


@app.command("wait-ready")
def wait_ready(
    url: str = typer.Option(..., help="server base URL, e.g. http://127.0.0.1:8000"),
    timeout: float = typer.Option(3600, help="seconds to wait before giving up"),
    poll: float = typer.Option(2.0, help="seconds between /health requests"),
) -> None:
    """Wait until /health answers 200 (a service's ExecStartPost); non-zero on 503 or timeout."""
    from servebook import server

    if not url.startswith(("http://", "https://")):
        _fail(ServebookError(f"--url {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000"), code=2)
    ok, message, _ = server.wait_ready(url, timeout, poll)
    typer.echo(message, err=not ok)
    raise typer.Exit(0 if ok else 1)


@app.command()
def watchdog(
    url: str = typer.Option(..., help="the service's base URL, e.g. http://127.0.0.1:8000"),
    unit: str = typer.Option("", help="the systemd unit to restart when no token comes (empty: only say so)"),
    timeout: float = typer.Option(60.0, help="seconds a one-token completion may take"),
    model: str = typer.Option("", help="the served model name; empty: the first /v1/models lists"),
) -> None:
    """Ask a server for one token (its key from VLLM_API_KEY); restart the unit when none comes: a hung engine
    answers /health. A unit still starting, or not running, is left to systemd."""
    import os
    import subprocess

    from servebook import client

    if unit:
        state = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True).stdout.strip()
        if state != "active":
            typer.echo(f"{unit} is {state or 'unknown'}: nothing to watch (systemd restarts a failed service)")
            raise typer.Exit(0)
    headers = client.bearer(os.environ.get("VLLM_API_KEY"))  # the unit's environment file gives the key
    fault = client.first_token(client.Target(url, model or client.served_name(url, headers), headers, timeout))
    if not fault:
        typer.echo(f"{url}: a token came back")
        raise typer.Exit(0)
    typer.echo(f"{url}: {fault}", err=True)
    if unit:
        subprocess.run(["systemctl", "restart", "--no-block", unit])
        typer.echo(f"restarting {unit}", err=True)
    raise typer.Exit(1)


@app.command("sync-notebooks")
def sync_notebooks() -> None:
    """Re-render every notebook's parameters cell from the parameter vocabulary (scripts/sync-notebooks.sh runs it)."""
    from servebook import runner

    for twin in runner.sync_parameter_cells([nb.with_suffix(".py") for nb in runner.stage_notebooks()]):
        typer.echo(f"updated {twin}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
