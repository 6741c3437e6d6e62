"""Stage 01: every layout vLLM would accept for the model on these GPUs, sized, ranked, and a gate before launch."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from pandas.io.formats.style import Styler

from servebook import gpus, hardware, loadpath, multinode, planner, raycluster, results, server_config, startplan
from servebook.errors import LayoutRejected, ServebookError
from servebook.params import Params
from servebook.planner import truth
from servebook.records import PlanRecord, ReconRecord
from servebook.units import GiB


def device_for(p: Params, run_dir: Path) -> planner.Device:
    """The hardware to plan for: a named GPU, what reconnaissance found, or the CPU."""
    found = results.read(run_dir, ReconRecord)
    inv = found.inventory if found else hardware.inventory()
    device = found.device if found and p.device == "auto" else hardware.resolve_device(p.device, inv)
    if device == "cpu" and not p.plan_gpu:
        kv = int(p.cpu_kv_cache_gib * GiB)
        return planner.Device.for_cpu(kv, p.nodes * p.per_node, p.nodes) if p.nodes > 1 else planner.Device.for_cpu(kv)
    name = p.plan_gpu or (inv.gpus[0].name if inv.gpus else "")
    if not name:
        raise ServebookError("plan_gpu is empty and NVML found no GPU; name the GPU to plan for (e.g. plan_gpu: H200)")
    link = None
    if p.nodes > 1:
        if not p.node_interconnect:
            raise ServebookError(
                f"nodes is {p.nodes} but node_interconnect is empty; name the network between the nodes, e.g. "
                "node_interconnect: 8x400Gb/s InfiniBand (the plan charges every collective that crosses it)"
            )
        link = planner.parse_interconnect(p.node_interconnect)
        per_node = p.gpus_per_node or len(inv.gpus) or p.per_node
        count = p.plan_gpu_count or p.nodes * per_node
    else:
        count = p.plan_gpu_count or len(p.gpu_ids) or len(inv.gpus) or p.world_size
    if p.plan_gpu:
        return planner.Device.for_gpu(gpus.lookup(name), count, nodes=p.nodes, link=link)
    # the real GPUs' readings beat the datasheet
    return planner.Device.for_gpu(
        gpus.lookup(name),
        count,
        nvlink=inv.nvlink_everywhere,
        memory_bytes=inv.gpus[0].memory_total,
        nodes=p.nodes,
        link=link,
    )


def make_plan(p: Params, device: planner.Device, evidence: loadpath.CheckpointEvidence | None = None) -> PlanRecord:
    """The plan for these params on this hardware, with the exact command each node would run for the layout
    the launch will use: the launch's own :class:`ServerConfig`, so what the plan prints is what starts."""
    planned = startplan.plan(p, device)
    launch_layout = "recommended" if p.layout_from_plan and planned.recommended else "params"
    record = PlanRecord(**dict(planned), requested=planned.find(p.layout), launch_layout=launch_layout)
    chosen = record.recommended if launch_layout == "recommended" else record.requested
    if chosen and chosen.accepted:
        record.load_evidence = evidence if evidence is not None else startplan.load_evidence(p, probe=False)
        record.load_choice, record.start_prediction = startplan.load_plan(p, planned, chosen, record.load_evidence)
        record.node_commands = launch_commands(p, planned.device, chosen.parallelism, record.load_choice)
        if planned.device.nodes > 1 and p.distributed_backend == "ray":
            record.ray_commands = ray_commands(p)
    return record


def launch_commands(
    p: Params, device: planner.Device, layout: planner.Parallelism, choice: loadpath.LoadChoice | None = None
) -> list[list[str]]:
    """What the launch stage runs for this layout: one command, or each node's, head first."""
    model = str(Path(p.model).parent) if p.model.endswith("config.json") else p.model  # vLLM loads the folder
    cfg = startplan.with_load_choice(
        server_config.ServerConfig.from_params(p.updated({"model": model}), device.kind, layout), choice
    )
    if device.nodes <= 1:
        return [cfg.command()]
    head = p.node_addresses[0] if p.node_addresses else multinode.HEAD_ADDRESS
    python = p.node_python or sys.executable
    return multinode.commands(cfg, device.nodes, device.per_node, head, p.node_master_port, python)


def ray_commands(p: Params) -> list[list[str]]:
    """Each node's ``ray start``, head first, as the launch runs them before the head's ``vllm serve``."""
    addresses = list(p.node_addresses) or [multinode.HEAD_ADDRESS] + [f"NODE{i}_ADDRESS" for i in range(1, p.nodes)]
    hosts = list(p.node_hosts) or ["local"] + [f"node{i}" for i in range(1, p.nodes)]
    nodes = p.updated({"node_addresses": addresses, "node_hosts": hosts}).nodes_section
    return raycluster.RayCluster.for_nodes(nodes).commands()


def run(p: Params, run_dir: str | Path) -> PlanRecord:
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, PlanRecord)  # a rerun never leaves the last attempt's record looking current
    found = results.read(run_dir, ReconRecord)
    record = make_plan(p, device_for(p, run_dir), found.checkpoint_io if found else None)
    results.write(run_dir, record)
    return record


def node_commands_text(record: PlanRecord) -> str:
    """Each node's command line, head first, as the launch stage will run it."""
    chosen = record.recommended if record.launch_layout == "recommended" else record.requested
    lines = [f"# {chosen.name}: {planner.MULTINODE_STRATEGIES[chosen.strategy]}"] if chosen and chosen.strategy else []
    for rank, argv in enumerate(record.ray_commands):
        lines.append(f"# node {rank}: {'start the Ray head' if rank == 0 else 'join the Ray cluster'}")
        lines.append(shlex.join(argv))
    if record.ray_commands:
        lines.append("# once Ray counts every node alive, on the head (serves the API; Ray places the workers)")
    for rank, argv in enumerate(record.node_commands):
        if len(record.node_commands) > 1:
            lines.append(f"# node {rank}{' (head: serves the API)' if rank == 0 else ''}")
        lines.append(shlex.join(argv))
    return "\n".join(lines)


def commands_or_why(record: PlanRecord, p: Params) -> str:
    """The launch's command lines, or why there are none: the refusal with its fix, never a bare "refused"."""
    if record.node_commands:
        return node_commands_text(record)
    why = refusal(record, p)
    return f"no command: {why}" if why else "no command: no layout fits"


def refusal(record: PlanRecord, p: Params) -> str | None:
    """Why stage 03 cannot launch what this plan hands it, with the fix that applies; None when it can."""
    if record.launch_layout != "params":
        return None
    own = record.requested
    rec = f"the plan recommends {record.recommended.name}" if record.recommended else "no layout fits"
    if own is None:
        world, count = p.world_size, record.device.count
        gpus = f"{world} GPU" + ("s" if world > 1 else "")
        return (
            f"the params' layout {planner.Parallelism.of(p).name} uses {gpus} (TP × PP × DP), the plan is for "
            f"{count}; set plan_gpu_count: {world} to plan for {gpus}"
            + (f" (or gpu_ids to pick {'it' if world == 1 else 'them'})" if world < count else "")
            + f", change the layout to use {count}, or set layout_from_plan: true ({rec})"
        )
    if not own.usable:
        return (
            f"vLLM would refuse {own.name}:\n  - "
            + "\n  - ".join(own.reasons)
            + f"\n{rec}; set layout_from_plan: true or change the layout"
        )
    return None


def verdict(record: PlanRecord, p: Params) -> str:
    """The plan's last word for the launch, in markdown: what stage 03 will start, or why it will not."""
    why = refusal(record, p)
    if why:
        head, *rest = why.split("\n")
        return "\n".join([f"**Stage 03 would not start this:** {head}", *rest, "", "(`servebook run` stops here.)"])
    layout = record.layout_for_launch or planner.Parallelism.of(p)
    source = {"chosen": "the explorer's choice", "recommended": "the plan's recommendation", "params": "the params"}
    return f"**Stage 03 launches {layout.name}** ({source[record.launch_layout]})."


def check(record: PlanRecord, p: Params) -> None:
    """Stop before a launch vLLM would refuse: the params' layout, when launch will use it."""
    why = refusal(record, p)
    if why:
        raise LayoutRejected(why)


def summary(record: PlanRecord) -> str:
    usable = sum(1 for layout in record.layouts if layout.usable)
    rec = f"recommends **{record.recommended.name}**" if record.recommended else "**no layout fits**"
    launch = record.recommended if record.launch_layout == "recommended" else record.requested
    used = f"; launch uses {launch.name}" if launch else ""
    if launch and not launch.usable:  # never "launch uses X" above X's refusal without saying so
        why = launch.reasons[0] if launch.reasons else "it does not fit"
        used += f", **which stage 03 would not start**: {why}"
    elif launch is None and record.launch_layout == "params" and record.recommended:
        used = "; the params' layout is for another GPU count, **which stage 03 would not start**"
    dev = record.device
    where = f"{dev.nodes} nodes of {dev.per_node} × {dev.name}" if dev.nodes > 1 else f"{dev.count} × {dev.name}"
    return (
        f"{usable} of {len(record.layouts)} layouts accepted and fit on {where}; {rec}{used}; {defaults_text(record)}"
    )


def defaults_text(record: planner.Plan) -> str:
    """Which vLLM the plan sized for, and whose table of defaults filled what the params left unset."""
    row = record.vllm_defaults_row
    borrowed = (
        f" (its defaults from vLLM {row}'s row, the nearest known)"
        if row and not record.vllm_version.startswith(row)
        else ""
    )
    if record.device.kind == "cpu":
        return f"sized for vLLM {record.vllm_version or row}{borrowed} on the CPU (a KV space of fixed size)"
    return f"sized for vLLM {record.vllm_version or row}{borrowed}, gpu_memory_utilization {record.gpu_memory_utilization:g}"


def reserve_text(record: planner.Plan) -> str:
    """What the plan keeps per GPU beside weights and KV cache, and where that figure comes from."""
    if record.device.kind == "cpu":
        return "the KV cache is a fixed size on the CPU"
    if record.activation_reserve_bytes is not None:
        return f"a fixed reserve of {record.activation_reserve_bytes / GiB:.1f} GiB per GPU (plan_reserve_gib)"
    sample = next((layout.reserve for layout in record.layouts if layout.reserve), None)
    tokens = f" at {sample.tokens:,} batched tokens" if sample else ""
    return (
        "vLLM's reserve per GPU modelled per layout as vLLM profiles it: activation peak"
        f"{tokens}, non-torch memory, CUDA graphs, and the memory CUDA does not report (column *reserve*)"
    )


def table(record: planner.Plan) -> pd.DataFrame:
    nodes = record.device.nodes > 1
    rows = []
    yes_no = {True: "yes", False: "no"}
    for layout in record.layouts:
        row: dict[str, object] = {
            "layout": layout.name, "vLLM accepts": yes_no[layout.accepted], "fits": yes_no[layout.fits]
        }  # fmt: skip
        if nodes:  # where the layout's groups fall, next to its name
            row["crosses nodes"] = "+".join(layout.crosses) or "none"
            row["launch"] = layout.strategy
            row["network collectives/token"] = layout.network_collectives_per_token
        row.update(
            {
                "weights GiB/GPU": round(layout.weight_bytes_per_gpu / GiB, 2),
                "reserve GiB/GPU": round(layout.reserve.total / GiB, 2) if layout.reserve else None,
                "KV bytes/token/GPU": int(layout.kv_bytes_per_token_per_gpu),
                "KV tokens/engine": layout.max_kv_tokens,
                "KV ± %": _band_pct(layout, "kv_tokens"),
                "figures from": layout.provenance or None,
                "max concurrency": round(layout.max_concurrency, 1),
                "experts/GPU": layout.experts_per_gpu,
                "collectives/token": layout.allreduces_per_token + layout.all2all_per_token,
                "1-stream ceiling tok/s": round(layout.decode_tok_s_single) if layout.decode_tok_s_single else None,
                # the batch it is ranked at: plan_batch, or the requests of max_model_len its KV cache holds
                "batch ranked at": layout.batch_fit if layout.decode_tok_s_batch else None,
                "ceiling at that batch tok/s": round(layout.decode_tok_s_batch) if layout.decode_tok_s_batch else None,
                "forecast tok/s": round(layout.forecast_tok_s_batch) if layout.forecast_tok_s_batch else None,
                "forecast ± %": _band_pct(layout, "forecast_tok_s"),
                "why not": "; ".join(layout.reasons),
            }
        )
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis=1, how="all")  # e.g. no reserve or ceilings on the CPU


def styled(record: planner.Plan) -> Styler:
    """The notebook's table as a person reads it: no index column, thousands separated (5,217,024 KV tokens),
    blanks where a figure does not apply."""
    frame = table(record)
    counts = [
        c for c in frame if c.endswith("tok/s") or c in ("KV bytes/token/GPU", "KV tokens/engine", "batch ranked at")
    ]
    tenths = [c for c in ("KV ± %", "forecast ± %", "max concurrency") if c in frame]
    return (
        frame.style.hide(axis="index")
        .format(na_rep="", precision=2, thousands=",")
        .format("{:,.0f}", subset=counts, na_rep="")
        .format("{:,.1f}", subset=tenths, na_rep="")
    )


# the terminal's table: the columns a choice rests on, under short headers (the notebook and --wide show all)
TERMINAL_COLUMNS = {
    "layout": "layout", "vLLM accepts": "accepted", "fits": "fits", "crosses nodes": "crosses",
    "weights GiB/GPU": "weights GiB", "KV tokens/engine": "KV tokens", "KV ± %": "±%", "max concurrency": "max conc",
    "ceiling at that batch tok/s": "ceiling tok/s", "forecast tok/s": "forecast tok/s", "forecast ± %": "±% ",
    "figures from": "from",
}  # fmt: skip


def terminal_table(record: planner.Plan) -> pd.DataFrame:
    """The plan's table narrowed to what fits a terminal (about 120 columns)."""
    full = table(record)
    return full[[c for c in TERMINAL_COLUMNS if c in full.columns]].rename(columns=TERMINAL_COLUMNS)


def _band_pct(layout: planner.Layout, figure: str) -> float | None:
    band = layout.bands.get(figure)
    return round(100 * band.band, 1) if band and band.band < 9 else None


RESERVE_TERMS = ("activation_gib", "cuda_graphs_gib", "non_torch_gib")


def _band_shown(name: str, band: truth.Band) -> str:
    """A figure's band as a person weighs it: a reserve term's in GiB, since a band of several times a term of a
    few MiB (the CUDA graphs of a small model) is a few MiB of KV memory, not a warning; the others' in percent."""
    label = name.removesuffix("_gib").replace("_", " ").replace("tok s", "tok/s")
    if name in RESERVE_TERMS:
        return f"{label} {band.value:.2f} ± {band.value * band.band:.2f} GiB"
    return f"{label} ±{100 * band.band:.1f} %"


def bands_text(record: planner.Plan) -> str:
    """How sure the plan is of the launch's layout, in one line: each figure's band and where it comes from."""
    chosen = record.layout_for_launch if isinstance(record, PlanRecord) else None
    requested = record.requested if isinstance(record, PlanRecord) else None
    layout = (record.find(chosen) if chosen else requested) or record.recommended
    if layout is None or not layout.bands:
        return ""
    shown = ", ".join(
        _band_shown(name, band) + ("" if band.provenance == layout.provenance else f" {band.provenance}")
        for name, band in layout.bands.items()
    )
    basis = f" KV {layout.kv_basis}." if layout.kv_basis else ""
    forecast = layout.bands.get("forecast_tok_s")
    if forecast and forecast.basis:
        basis += f" Forecast {forecast.basis}."
    return f"{layout.name}: figures {layout.provenance} ({shown}).{basis}"


def device_text(record: planner.Plan) -> str:
    """The hardware planned for, in one line of markdown."""
    dev = record.device
    if dev.nodes > 1:
        link = dev.link.name if dev.link else "an unnamed network"
        return f"**{dev.nodes} nodes × {dev.per_node} {dev.name}** joined by {link}"
    return f"**{dev.count} × {dev.name}**"


def memory_figure(record: PlanRecord) -> go.Figure:
    """Weights by part and the KV cache per GPU for every accepted layout, against the usable memory."""
    rows = [
        {"layout": layout.name, "part": part, "GiB": b / GiB}
        for layout in record.layouts
        if layout.accepted
        for part, b in layout.weight_breakdown.items()
    ]
    rows += [
        {"layout": layout.name, "part": "vLLM's reserve", "GiB": layout.reserve.total / GiB}
        for layout in record.layouts
        if layout.accepted and layout.reserve
    ]
    rows += [
        {"layout": layout.name, "part": "KV cache", "GiB": layout.available_kv_bytes_per_gpu / GiB}
        for layout in record.layouts
        if layout.accepted
    ]
    if record.device.kind != "cuda":
        # the CPU backend's KV cache is a fixed size, not what is left of a GPU: no memory line to fill up to
        kv = f"{record.device.cpu_kv_bytes / GiB:g} GiB" if record.device.cpu_kv_bytes else "fixed"
        return px.bar(rows, x="layout", y="GiB", color="part", title=f"Weights and KV cache ({kv}, cpu_kv_cache_gib)")
    fig = px.bar(
        rows, x="layout", y="GiB", color="part", title="Weights, reserve and KV cache per GPU (accepted layouts)"
    )
    usable = record.device.memory_bytes / GiB * record.gpu_memory_utilization
    fig.add_hline(y=usable, line_dash="dash", annotation_text="usable memory")
    return fig
