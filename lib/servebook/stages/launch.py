"""Stage 03: from parameters and earlier stages' records to a ready server, recorded in ``03_launch.json``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import psutil

from servebook import (
    client,
    hardware,
    loadpath,
    models,
    planner,
    rehearsal,
    results,
    router,
    server,
    startplan,
    startup,
    topology,
    ui,
    vllm_compat,
)
from servebook.errors import LaunchError, PreflightError
from servebook.params import Params
from servebook.records import (
    DownloadRecord,
    DryStart,
    GpuMemory,
    LaunchRecord,
    MemoryAfterLoad,
    PlanCheck,
    PlanRecord,
    ProcessMemory,
    ReconRecord,
    RehearsalCheck,
    RehearsalRecord,
)


def config_for(p: Params, run_dir: Path) -> server.ServerConfig:
    """The server this run launches: the params, with the rehearsal's winner (else the plan's layout) and the
    download's folder where they ran."""
    found = results.read(run_dir, ReconRecord)
    device = found.device if found and p.device == "auto" else hardware.resolve_device(p.device, hardware.inventory())
    plan = results.read(run_dir, PlanRecord)
    downloaded = results.read(run_dir, DownloadRecord)
    winner = rehearsed_winner(p, run_dir)
    layout = winner.layout if winner else (plan.layout_for_launch if plan else None)
    cfg = server.ServerConfig.from_params(p, device, layout, model_path=downloaded.local_path if downloaded else None)
    return startplan.with_load_choice(cfg, load_choice_for(p, cfg, plan))


def rehearsed_winner(p: Params, run_dir: Path) -> rehearsal.Rehearsed | None:
    """The rehearsal's winner (measured, or a person's pick), when there is one and the params let it choose."""
    rehearsed = results.read(run_dir, RehearsalRecord)
    return rehearsed.chosen if rehearsed and p.rehearse_picks_launch else None


def gpus_for(p: Params, run_dir: str | Path) -> list[int]:
    """The GPUs this launch will use (the live panel's); none on the CPU."""
    return config_for(p, results.run_folder(run_dir)).target_gpus


def load_choice_for(p: Params, cfg: server.ServerConfig, plan: PlanRecord | None) -> loadpath.LoadChoice:
    """The plan's load choice where it saw the checkpoint on disk; else the rule table on what is there now."""
    if plan and plan.load_choice and plan.load_evidence and not plan.load_evidence.error:
        return plan.load_choice
    evidence = loadpath.gather(cfg.model_path, probe=False)
    choice = loadpath.recommend(evidence, expert_parallel=cfg.layout.ep, vllm_version=vllm_compat.vllm_version())
    if p.load_strategy != "auto":
        choice.load_strategy = p.load_strategy
    return choice


def check_load_options(cfg: server.ServerConfig) -> None:
    """Load options the installed vLLM cannot take stop the launch before anything starts."""
    problems = loadpath.option_problems(
        cfg.load_strategy, cfg.load_format, cfg.ep_weight_filter, expert_parallel=cfg.layout.ep
    )
    problems += ready_timeout_problems(cfg)
    if problems:
        raise PreflightError("nothing started:\n  - " + "\n  - ".join(problems))


def ready_timeout_problems(cfg: server.ServerConfig) -> list[str]:
    """vLLM's own wait for its engines (VLLM_ENGINE_READY_TIMEOUT_S; the data-parallel coordinator waits for the
    other nodes' engines under it) set in extra_env below the load budget: the load would be cut short."""
    given = cfg.extra_env.get("VLLM_ENGINE_READY_TIMEOUT_S")
    budget = cfg.load_budget_s()
    if given is None:
        return []
    if not given.isdigit() or int(given) < budget:
        return [
            f"extra_env sets VLLM_ENGINE_READY_TIMEOUT_S={given}, under the load budget of {budget:.0f} s: vLLM would "
            "give up on its engines (on other nodes too) before they load; take it out of extra_env (servebook sets "
            "it to the budget) or raise load_timeout_s"
        ]
    return []


def dry_start(cfg: server.ServerConfig, run_dir: Path, p: Params, predicted: planner.Layout | None) -> DryStart:
    """The exact command with ``--load-format dummy``, started, measured and stopped."""
    dry = cfg.dry()
    print(f"dry start: {' '.join(dry.command()[-6:])} ...")
    try:
        launch = server.launch(
            dry,
            run_dir / "dry-run",
            stop_leftovers=p.stop_leftovers,
            on_progress=ui.load_progress(p.interactive, "dry start"),
        )
    except LaunchError as exc:
        return DryStart(command_line=" ".join(dry.command()), ok=False, error=exc.cause or str(exc))
    try:
        record = DryStart.of(launch, predicted)
    finally:
        server.stop(port=dry.port)
    return record


def memory_after_load(launch: server.Launch) -> MemoryAfterLoad:
    """Per-GPU memory in use (cuda), or the server processes' resident memory (cpu)."""
    if launch.config.device == "cuda":
        wanted = launch.config.target_gpus
        return MemoryAfterLoad(
            per_gpu=[
                GpuMemory(gpu=g.index, used_bytes=g.memory_used, total_bytes=g.memory_total)
                for g in hardware.inventory().gpus
                if g.index in wanted
            ]
        )
    procs = []
    for proc in server.group_members(launch.pgid):
        try:
            procs.append(ProcessMemory(pid=proc.pid, title=hardware.title(proc)[:60], rss_bytes=proc.memory_info().rss))
        except psutil.NoSuchProcess:
            continue
    return MemoryAfterLoad(processes=procs, rss_total_bytes=sum(p.rss_bytes for p in procs))


def run(p: Params, run_dir: str | Path) -> LaunchRecord:
    """Launch (or reuse) the server the parameters describe; write and return the record."""
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, LaunchRecord)  # a rerun never leaves the last attempt's record looking current
    plan = results.read(run_dir, PlanRecord)
    rehearsed = results.read(run_dir, RehearsalRecord)
    p = plan.params_for_launch(p) if plan else p
    p = rehearsed.params_for_launch(p) if rehearsed else p
    cfg = config_for(p, run_dir)
    check_load_options(cfg)
    predicted = startplan.for_start(plan, cfg, plan.find(cfg.layout)) if plan else None
    dry = dry_start(cfg, run_dir, p, predicted) if p.launch_dry_run else None
    if dry and not dry.ok:
        raise LaunchError("the dry start (--load-format dummy) failed; nothing was read", cause=dry.error)
    topo = topology.of(p, cfg, run_dir)
    topo.preflight()  # every machine checked before anything starts; on several nodes cfg becomes the head's part
    cached_share, kernels_cached = startup.state_before_start(topo.cfg.model_path)
    started = topo.start()
    launch = started.launch
    cfg = launch.config
    registered = server.registered(cfg.port)
    if dry and launch.values.kv_cache_tokens and launch.timeline:
        dry.real_adds = real_adds(dry, launch)
    if plan:
        startplan.learn(plan, predicted, launch.values, "launch")
    record = LaunchRecord.of(
        launch,
        layout_source=layout_source(p, run_dir, plan),
        memory_after_load=memory_after_load(launch),
        plan_check=PlanCheck.of(predicted, launch.values) if predicted else None,
        nodes=started.probes,
        workers=registered.workers if registered else [],
        timeline=launch.timeline,
        start_prediction=plan.start_prediction if plan else None,
        load_choice=load_choice_for(p, cfg, plan),
        dry_run=dry,
        replicas=started.replicas,
        router=started.router,
        topology=topo.shape,
        rehearsal_check=rehearsal_check(rehearsed, launch),
    )
    if launch.timeline and not launch.reused:
        remember_start(cfg, launch, cached_share, kernels_cached)
    results.write(run_dir, record)
    return record


def layout_source(p: Params, run_dir: Path, plan: PlanRecord | None) -> str:
    if rehearsed_winner(p, run_dir):
        return "rehearsal"
    if plan and plan.layout_for_launch:
        return "explorer" if plan.launch_layout == "chosen" else "plan"
    return "params"


def rehearsal_check(rehearsed: RehearsalRecord | None, launch: server.Launch) -> RehearsalCheck | None:
    """The real start against the rehearsal of the same server: the KV cache must be the same."""
    found = rehearsed.matching(launch.config) if rehearsed else None
    if found is None or launch.reused:
        return None
    return RehearsalCheck.of(found, launch.values.kv_cache_tokens, launch.values.compile_cache)


def rehearsal_text(record: LaunchRecord) -> str:
    """This start against its rehearsal on dummy weights, in words."""
    c = record.rehearsal_check
    if c is None:
        return "no rehearsal of this server in this run"
    if c.rehearsed_kv_tokens is None or c.real_kv_tokens is None:
        return f"rehearsal of {c.candidate}: vLLM logged no KV size for one of the two starts"
    verdict = c.note if c.note else "the same KV cache"
    return (
        f"rehearsal of {c.candidate}: {c.rehearsed_kv_tokens:,} KV tokens on dummy weights, {c.real_kv_tokens:,} "
        f"with the real ones ({c.kv_diff_pct:+.3f} %): {verdict}"
    )


def real_adds(dry: DryStart, launch: server.Launch) -> str:
    """What the real start cost beyond the dry one, and whether they sized the same KV cache."""
    assert launch.timeline is not None
    same = (
        "the same KV cache"
        if dry.kv_cache_tokens == launch.values.kv_cache_tokens
        else (f"KV {dry.kv_cache_tokens:,} dry against {launch.values.kv_cache_tokens:,} real tokens")
    )
    extra = launch.timeline.total_s - dry.seconds_to_ready
    read = launch.timeline.seconds("weights_read") + launch.timeline.seconds("post_processing")
    return f"{same}; the real start took {extra:+.0f} s more, {read:.0f} s of it reading and post-processing weights"


def remember_start(
    cfg: server.ServerConfig, launch: server.Launch, cached_share: float | None, kernels_cached: bool
) -> None:
    """The start joins servebook's history, with the caches as it found them; the next plan predicts from it."""
    assert launch.timeline is not None
    size, _ = models.checkpoint_bytes(cfg.model_path)
    version = launch.values.vllm_version or vllm_compat.vllm_version()
    startup.remember_launch(
        cfg, launch.timeline, version, bytes_per_rank=float(size or 0), cached_share=cached_share,
        kernels_cached=kernels_cached,
    )  # fmt: skip


def check(record: LaunchRecord, p: Params) -> None:
    """The server the record names still answers: a later stage can rely on it."""
    if record.router:
        sick = [w.url for w in router.workers(record.router.url) if not w.healthy]
        if sick or not router.workers(record.router.url):
            raise LaunchError(
                f"the router at {record.router.url} lists replicas that are not healthy: {sick or 'none answer'}",
                log_path=record.router.log_path,
            )
        return
    state = client.health(record.url)
    if state != "ready":
        raise LaunchError(
            f"the server at {record.url} is not ready after its launch (/health: {state})", log_path=record.log_path
        )


def summary(record: LaunchRecord) -> str:
    how = "reused a running server" if record.reused else f"ready in {record.seconds_to_ready:.0f} s"
    if record.replicas and not record.reused:  # the slowest replica is what the router waited for
        how = f"every replica ready in {max(r.seconds_to_ready for r in record.replicas):.0f} s"
    kv = record.vllm_reported.kv_cache_tokens
    predicted = f" (plan: {record.plan_check.predicted_kv_tokens:,})" if record.plan_check else ""
    kv_text = f"; KV cache {kv:,} tokens{predicted}" if kv else ""
    across = f" across {len(record.workers) + 1} nodes" if record.workers else ""
    if record.router:
        across += (
            f", {len(record.replicas)} replicas behind vllm-router ({record.router.policy}) at {record.router.url}"
        )
    return (
        f"`{record.config.served_model_name}` at {record.layout.name} on {record.config.device}{across}, {how}{kv_text}"
    )


def replica_table(record: LaunchRecord) -> pd.DataFrame:
    """Each replica behind the router: where it listens, its GPUs, its start, and whether the router sees it."""
    seen = {w.url: w.healthy for w in router.workers(record.router.url)} if record.router else {}
    return pd.DataFrame(
        [
            {"replica": r.index, "machine": r.node or "this one", "url": r.url,
             "GPUs": ", ".join(map(str, r.gpu_ids)) or "CPU", "pid": r.pid,
             "ready in s": r.seconds_to_ready, "healthy at the router": seen.get(r.url), "log": r.log_path}
            for r in record.replicas
        ]
    )  # fmt: skip


def phase_table(record: LaunchRecord) -> pd.DataFrame:
    """Each start-up phase with its seconds, vLLM's own figure, and what it folds in; unaccounted last."""
    if record.timeline is None:
        return pd.DataFrame(
            sorted(record.phases.items(), key=lambda kv: kv[1]), columns=["phase", "seconds since start"]
        )
    rows = [
        {"phase": p.label, "starts at s": p.start_s, "seconds": p.seconds, "vLLM says s": p.vllm_s,
         "folds in": ", ".join(p.includes)}
        for p in record.timeline.phases
    ] + [{"phase": "unaccounted", "seconds": record.timeline.unaccounted_s}]  # fmt: skip
    table = pd.DataFrame(rows)
    return table.astype(object).where(table.notna(), "")  # a phase vLLM gives no figure for shows nothing


def timeline_starts(record: LaunchRecord) -> list[tuple[str, dict[str, float]]]:
    """This start, the plan's prediction of it and the dry start, each as phase -> seconds, for the timeline plot."""
    starts = []
    if record.timeline:
        tl = record.timeline
        starts.append(("this start", {p.name: p.seconds for p in tl.phases} | {"unaccounted": tl.unaccounted_s}))
    if record.start_prediction:
        starts.append(("plan's prediction", dict(record.start_prediction.phases)))
    if record.dry_run and record.dry_run.timeline:
        dry = record.dry_run.timeline
        starts.append(("dry start", {p.name: p.seconds for p in dry.phases} | {"unaccounted": dry.unaccounted_s}))
    return starts


def timeline_text(record: LaunchRecord) -> str:
    """The start in one paragraph: total, slowest phase with its fix, the plan's prediction beside it."""
    tl = record.timeline
    if tl is None:
        return "reused a running server: no start to explain"
    lines = [tl.summary(), f"slowest: {tl.slowest} — {tl.slowest_fix}"]
    if record.start_prediction:
        pred = record.start_prediction
        error = 100 * (pred.total_s - tl.total_s) / tl.total_s if tl.total_s else 0.0
        lines.append(f"the plan predicted {pred.total_s:.0f} s ({error:+.0f} %): {pred.limit}")
    if record.load_choice:
        lines.append(
            "load path: "
            + (" ".join(record.load_choice.flags()) or "vLLM's default")
            + " — "
            + "; ".join(record.load_choice.reasons)
        )
    if record.dry_run:
        d = record.dry_run
        lines.append(
            f"dry start: ready in {d.seconds_to_ready:.0f} s, KV {d.kv_cache_tokens or 0:,} tokens (plan {d.predicted_kv_tokens or 0:,}); {d.real_adds}"
        )
    return "\n".join(lines)
