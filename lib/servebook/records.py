"""The typed record of every stage: what each ``NN_<stage>.json`` holds.

One class per results file, with units in field names where a number has one.  A stage
produces its record, later stages and the report read it through this type
(``results.read(run, LaunchRecord)``).  The parts are the core modules' own result types.
"""

from __future__ import annotations

import dataclasses
import subprocess
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, computed_field, model_validator

from servebook import (
    ab,
    bench,
    client,
    download,
    environment,
    hardware,
    loadpath,
    multinode,
    nccl,
    planner,
    ratesweep,
    rehearsal,
    remote,
    server,
    serving,
    startup,
    systemd,
    topology,
)
from servebook.ab import RehearsedAb
from servebook.errors import PreflightError
from servebook.planner import Parallelism
from servebook.replicas import ReplicaRecord as ReplicaRecord  # one of several servers behind a router
from servebook.results import Record
from servebook.router import RouterRecord
from servebook.secrets import mask, mask_env
from servebook.topology import Shape
from servebook.units import GiB
from servebook.vllm_log import LogValues

if TYPE_CHECKING:
    from servebook.params import Params

# ---------------------------------------------------------------- 00 reconnaissance


class Verdict(BaseModel):
    ready: bool
    reasons: list[str]  # each one blocks serving
    notes: list[str]  # worth knowing, not blocking


class CheckpointSize(BaseModel):
    model: str
    bytes: int | None  # None when neither the disk nor the hub could say
    on_local_disk: bool


class ReconRecord(Record):
    FILE = "00_reconnaissance"

    device: Literal["cuda", "cpu"]
    target_gpus: list[int]
    inventory: hardware.Inventory
    host: environment.Host
    versions: dict[str, str | None]
    checkpoint: CheckpointSize
    verdict: Verdict
    nodes: list[multinode.NodeProbe] = []  # several nodes: each as its probe found it, head first
    checkpoint_io: loadpath.CheckpointEvidence | None = None  # a local checkpoint: what a load reads, how fast


# ---------------------------------------------------------------- 01 plan


class LayoutChoice(BaseModel):
    """A layout and the settings a person chose in the plan's explorer ("use this layout"), for stage 03."""

    layout: Parallelism
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    kv_tokens: int  # what the plan sized for them, per engine
    chosen_at: str = ""

    def overrides(self) -> dict[str, object]:
        """The params this choice replaces, as the params name them."""
        return {
            **self.layout.params(),
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "layout_from_plan": False,
        }


class PlanRecord(Record, planner.Plan):
    FILE = "01_plan"

    requested: planner.Layout | None  # the params' own layout as the plan judged it
    # which one the launch stage uses; "chosen": the explorer's choice (``chosen``)
    launch_layout: Literal["recommended", "params", "chosen"]
    chosen: LayoutChoice | None = None
    node_commands: list[list[str]] = []  # several nodes: each node's vllm serve command, head first
    ray_commands: list[list[str]] = []  # distributed_backend ray: each node's `ray start`, head first, run before
    load_evidence: loadpath.CheckpointEvidence | None = None
    load_choice: loadpath.LoadChoice | None = None  # the rule table's choice for the launch layout
    start_prediction: startup.StartPrediction | None = None  # for the launch layout and load path

    @property
    def layout_for_launch(self) -> Parallelism | None:
        """The layout handed to the launch stage, or None when launch keeps the params' layout."""
        if self.launch_layout == "chosen" and self.chosen:
            return self.chosen.layout
        if self.launch_layout == "recommended" and self.recommended:
            return self.recommended.parallelism
        return None

    def params_for_launch(self, p: Params) -> Params:
        """The params stage 03 launches with: the explorer's choice over the params where one was made."""
        if self.launch_layout == "chosen" and self.chosen:
            return p.choice_over(self.chosen.overrides(), source="the layout chosen in 01_plan")
        return p


# ---------------------------------------------------------------- 02 download


class DownloadRecord(Record):
    FILE = "02_download"

    source: Literal["builtin", "local", "hub"]
    model: str
    local_path: str
    revision: str | None = None
    commit: str | None = None
    listing: download.ListingInfo | None = None
    preflight: download.Preflight | None = None
    fetch: download.Fetched | None = None
    bytes: int
    verification: download.Verification
    page_cache: PageCacheWarmup | None = None


class PageCacheWarmup(BaseModel):
    """The checkpoint read into the page cache after verification, so the first start reads RAM, not disk."""

    done: bool
    bytes_read: int = 0
    seconds: float = 0.0
    cached_after_pct: float | None = None
    why_not: str = ""


# ---------------------------------------------------------------- 02 rehearse


class RehearsalRecord(Record):
    """Every candidate server started on dummy weights, swept briefly, stopped; ranked by what it measured."""

    FILE = "02_rehearse"

    model_path: str  # config, tokenizer and index the dummy starts read (the download's folder, headers first)
    routing: str  # the routing simulation every candidate ran with ("" where none)
    routing_note: str = ""  # why none ran
    ranked_by: Literal["goodput", "output tok/s"]
    candidates: list[rehearsal.Rehearsed]
    winner: str = ""  # a candidate's name; "" when none measured
    picked_by: Literal["measurement", "person"] = "measurement"
    why: str = ""
    budget_s: float = 0.0
    seconds: float = 0.0
    download_overlap_s: float | None = None  # seconds the rehearsal ran while the download was still running
    primed: rehearsal.Primed | None = None  # the winner started as stage 03 starts it, for its compile cache
    interrupted: str = ""

    def find(self, name: str) -> rehearsal.Rehearsed | None:
        return next((c for c in self.candidates if c.name == name), None)

    @property
    def chosen(self) -> rehearsal.Rehearsed | None:
        return self.find(self.winner) if self.winner else None

    def params_for_launch(self, p: Params) -> Params:
        """The params stage 03 launches with: the winner's layout and settings over the params."""
        chosen = self.chosen
        if chosen is None or not p.rehearse_picks_launch:
            return p
        return p.choice_over(chosen.launch_changes(), source=f"the rehearsal's {self.picked_by} pick ({chosen.name})")

    def matching(self, cfg: server.ServerConfig) -> rehearsal.Rehearsed | None:
        """The measured candidate the launched server is: the winner when it was launched, else the one of its
        layout whose settings it has, the most specific first (a candidate "as set" changes nothing, so every
        server of its layout has its settings)."""
        chosen = self.chosen
        if chosen is not None and chosen.layout == cfg.layout and self._has(cfg, chosen):
            return chosen
        fits = [c for c in self.candidates if c.layout == cfg.layout and c.status in ("measured", "dropped")]
        fits = [c for c in fits if self._has(cfg, c)]
        return max(fits, key=lambda c: len(c.changes), default=None)

    @staticmethod
    def _has(cfg: server.ServerConfig, c: rehearsal.Rehearsed) -> bool:
        return all(getattr(cfg, k, v) == v for k, v in c.changes.items() if k not in ("extra_env", "extra_args"))


class RehearsalCheck(BaseModel):
    """The real launch against its rehearsal: KV must match, throughput is compared by the benchmark. vLLM sizes
    the KV cache from its profile peak, which a cold torch.compile raises; so a gap is read against both starts'
    compile-cache states."""

    candidate: str
    rehearsed_kv_tokens: int | None
    real_kv_tokens: int | None
    kv_diff_pct: float | None
    kv_match: bool
    rehearsed_compile_cache: str | None = None
    real_compile_cache: str | None = None
    # a cold start on real weights, where the rehearsal knew it keeps more than dummy weights (MLA): what it expected
    expected_kv_tokens: int | None = None
    expected_diff_pct: float | None = None
    note: str = ""

    @classmethod
    def of(cls, rehearsed: rehearsal.Rehearsed, real_kv: int | None, compile_cache: str | None) -> RehearsalCheck:
        kv = rehearsed.kv_cache_tokens
        diff = round(100 * (real_kv - kv) / kv, 3) if kv and real_kv else None
        expected = rehearsed.real_kv_tokens_expected if compile_cache == "miss" else None
        off = round(100 * (real_kv - expected) / expected, 3) if expected and real_kv else None
        match = diff is not None and abs(diff if off is None else off) <= 0.1
        note = ""
        if diff is not None and (not match or off is not None):
            more_or_less = "fewer" if diff < 0 else "more"
            note = f"the real start sized {abs(diff):.2f} % {more_or_less} KV tokens than the rehearsal" + (
                _compile_reading(rehearsed.compile_cache, compile_cache)
                if off is None
                else f", {off:+.3f} % from the {expected:,} expected of a first start on real weights (on MLA it "
                "keeps more in vLLM's profile peak than dummy weights, in proportion to the batched tokens)"
            )
        return cls(candidate=rehearsed.name, rehearsed_kv_tokens=kv, real_kv_tokens=real_kv, kv_diff_pct=diff,
                   kv_match=match, rehearsed_compile_cache=rehearsed.compile_cache, real_compile_cache=compile_cache,
                   expected_kv_tokens=expected, expected_diff_pct=off, note=note)  # fmt: skip


def _compile_reading(rehearsed: str | None, real: str | None) -> str:
    """Why a KV gap between the rehearsal and the real start may be there, from the two compile-cache states."""
    if rehearsed == real == "miss":
        return (
            " (both starts compiled cold, so the gap is vLLM's profile of the real weights against dummy ones, or"
            " on a GQA model what each compile left for Python's collector in the profile peak, none to 1.5 GiB"
            " from start to start: the GLM-4.5-Air mini at 8 layers, 2.8 % of its KV)"
        )
    if rehearsed == real:
        how = {"hit": "loaded their compile caches", None: "compiled nothing"}.get(
            rehearsed, f"compile cache {rehearsed}"
        )
        return f" (both starts {how}, so the gap is vLLM's profile of the real weights against dummy ones)"
    cold_peak = "a cold compile keeps more in the profile peak"
    if real == "miss" and rehearsed == "hit":
        return f" (this start compiled cold and the rehearsal loaded its compile cache: {cold_peak})"
    if real == "hit" and rehearsed == "miss":
        return f" (the rehearsal compiled cold and this start loaded its compile cache: {cold_peak})"
    return f" (compile cache: rehearsal {rehearsed or 'not recorded'}, this start {real or 'nothing compiled'})"


# ---------------------------------------------------------------- 03 launch


class GpuMemory(BaseModel):
    gpu: int
    used_bytes: int
    total_bytes: int


class ProcessMemory(BaseModel):
    pid: int
    title: str
    rss_bytes: int


class MemoryAfterLoad(BaseModel):
    per_gpu: list[GpuMemory] = []  # on GPUs
    processes: list[ProcessMemory] = []  # on the CPU: the server's processes
    rss_total_bytes: int = 0


LEFT_BY_KV_MEMORY = "activation peak + non-torch, from the KV memory"
# the launch record's term names (vLLM's) and the plan's band keys (planner.truth)
BAND_OF_TERM = {
    "activation peak": "activation_gib",
    "non-torch": "non_torch_gib",
    "CUDA-graph estimate": "cuda_graphs_gib",
}


def _left_by_kv_memory(predicted: planner.Layout, reported: LogValues) -> tuple[float, float] | None:
    """Where vLLM logged no memory profile (it does at DEBUG): the activation peak and non-torch memory together,
    as the lines it logs at INFO leave them (the memory it was given, less weights, CUDA-graph estimate and KV
    memory), beside the plan's; (plan GiB, vLLM GiB), None where a line is missing. A KV miss then still names
    its term: the DeepSeek-V3-shaped mini's −0.59 % at 128 requests was this term 2.30 GiB under the plan and the
    graph estimate 1.58 over it (before the graph term counted attention heads; since, 0.09 over)."""
    reserve = predicted.reserve
    weights, graphs, kv = reported.model_memory_gib, reported.graph_estimate_gib, reported.kv_cache_memory_gib
    if graphs is None and reserve is not None and not reserve.cuda_graphs:
        graphs = 0.0  # eager: vLLM captures nothing and logs no estimate
    if reserve is None or reserve.flat or reported.activation_peak_gib is not None or None in (weights, graphs, kv):
        return None
    planned = (reserve.activation + reserve.non_torch) / GiB
    available_as_planned = (predicted.available_kv_bytes_per_gpu - predicted.learned_bytes) / GiB
    left = (
        planned + available_as_planned - kv  # type: ignore[operator]
        - (weights - predicted.weight_bytes_per_gpu / GiB)  # type: ignore[operator]
        - (graphs - reserve.cuda_graphs / GiB)  # type: ignore[operator]
    )  # fmt: skip
    return round(planned, 3), round(left, 2)


def _size(gib: float) -> str:
    """GiB to two places, or MiB where that would read 0.00 (the embedded default's weights)."""
    return f"{gib:.2f} GiB" if abs(gib) >= 0.1 or gib == 0 else f"{gib * 1024:.1f} MiB"


class PlanCheck(BaseModel):
    """The plan's prediction for the launched layout beside what vLLM logged."""

    layout: str
    predicted_kv_tokens: int
    reported_kv_tokens: int | None
    predicted_weight_gib: float
    reported_weight_gib: float | None
    kv_tokens_error_pct: float | None = None
    weight_error_pct: float | None = None
    # the reserve term by term, GiB: the plan's and the line vLLM's memory profile logged for it (None: not logged,
    # vLLM logs the profile at DEBUG); "memory CUDA does not report" has no line of its own
    reserve_terms: dict[str, tuple[float, float | None]] = {}
    # the plan's band for each figure it stated one for (planner.truth), by the names above
    bands: dict[str, planner.truth.Band] = {}
    planned_for: str = ""  # the start the figures were planned for: a cold compile, a compile-cache hit, none

    @classmethod
    def of(cls, predicted: planner.Layout, reported: LogValues) -> PlanCheck:
        def error(p: float, r: float | None) -> float | None:
            return 100 * (p - r) / r if r else None

        weight_gib = predicted.weight_bytes_per_gpu / GiB
        logged = {
            "activation peak": reported.activation_peak_gib,
            "non-torch": reported.non_torch_gib,
            "CUDA-graph estimate": reported.graph_estimate_gib,
        }
        terms = predicted.reserve.terms() if predicted.reserve else {}
        reserve_terms = {name: (round(gib, 3), logged.get(name)) for name, gib in terms.items()}
        if left := _left_by_kv_memory(predicted, reported):
            reserve_terms[LEFT_BY_KV_MEMORY] = left
        named = {"KV tokens": "kv_tokens", "weights per GPU": "weights_gib", **BAND_OF_TERM}
        bands = {name: predicted.bands[key] for name, key in named.items() if key in predicted.bands}
        start = {
            "True": "a start that loads torch.compile's cache (one with the same compile key ran before)",
            "False": "a start that compiles cold",
        }.get(predicted.settings.get("compile_cache_hit", ""), "")
        if predicted.settings.get("enforce_eager") == "True":
            start = "a start that compiles nothing (enforce_eager)"
        return cls(
            layout=predicted.name,
            bands=bands,
            planned_for=start,
            predicted_kv_tokens=predicted.max_kv_tokens,
            reported_kv_tokens=reported.kv_cache_tokens,
            predicted_weight_gib=weight_gib,
            reported_weight_gib=reported.model_memory_gib,
            kv_tokens_error_pct=error(predicted.max_kv_tokens, reported.kv_cache_tokens),
            weight_error_pct=error(weight_gib, reported.model_memory_gib),
            reserve_terms=reserve_terms,
        )

    def band_verdicts(self) -> dict[str, str]:
        """For each figure with a band and a logged value: "±x % · inside" or "±x % · outside"."""
        reported: dict[str, float | None] = {
            "KV tokens": self.reported_kv_tokens,
            "weights per GPU": self.reported_weight_gib,
            **{name: vllm for name, (_, vllm) in self.reserve_terms.items()},
        }
        verdicts = {}
        for name, band in self.bands.items():
            vllm = reported.get(name)
            if vllm is not None:
                verdicts[name] = f"±{100 * band.band:.1f} % · {'inside' if band.contains(vllm) else 'outside'}"
        return verdicts

    def markdown(self) -> str:
        """The check as stage 03 shows it: each figure, the plan's, vLLM's, and the plan's band with its verdict."""
        verdicts = self.band_verdicts()
        kv_error = f" ({self.kv_tokens_error_pct:+.2f} %)" if self.kv_tokens_error_pct is not None else ""
        weights = _size(self.reported_weight_gib) if self.reported_weight_gib else "not logged by this vLLM"
        rows = [
            f"| {self.layout} | plan | vLLM | plan's band |",
            "|---|---|---|---|",
            f"| KV tokens | {self.predicted_kv_tokens:,} | {self.reported_kv_tokens or 0:,}{kv_error} | "
            f"{verdicts.get('KV tokens', '')} |",
            f"| weights per GPU | {_size(self.predicted_weight_gib)} | {weights} | "
            f"{verdicts.get('weights per GPU', '')} |",
        ]
        for name, (plan, logged) in self.reserve_terms.items():
            vllm = "—" if logged is None else _size(logged)
            rows.append(f"| {name} | {_size(plan)} | {vllm} | {verdicts.get(name, '')} |")
        kv = self.bands.get("KV tokens")
        said = [f"Planned for {self.planned_for}."] if self.planned_for else []
        said += [f"The KV figure: {kv.basis}."] if kv and kv.basis else []
        if said:
            rows += ["", " ".join(said)]
        return "\n".join(rows)

    def worst_term(self) -> str:
        """The logged term furthest from the plan's, named with both figures: where the next miss comes from."""
        gaps = [(abs(p - r), name, p, r) for name, (p, r) in self.reserve_terms.items() if r is not None]
        if not gaps:
            return "vLLM logged no memory profile (VLLM_LOGGING_LEVEL=DEBUG logs it)"
        gap, name, p, r = max(gaps)
        return f"{name}: plan {p:.2f} GiB, vLLM {r:.2f} GiB ({p - r:+.2f} GiB)"


class DryStart(BaseModel):
    """A start with ``--load-format dummy``: the exact command's flags, shapes, KV sizing and graphs, no read."""

    command_line: str
    ok: bool
    seconds_to_ready: float = 0.0
    kv_cache_tokens: int | None = None
    predicted_kv_tokens: int | None = None
    kv_tokens_error_pct: float | None = None  # the plan against the dry start
    weights_gib: float | None = None
    timeline: startup.Timeline | None = None
    error: str = ""
    real_adds: str = ""  # what the real start adds to this one

    @classmethod
    def of(cls, launch: server.Launch, predicted: planner.Layout | None) -> DryStart:
        kv = launch.values.kv_cache_tokens
        plan_kv = predicted.max_kv_tokens if predicted else None
        return cls(
            command_line=mask(subprocess.list2cmdline(launch.command)),
            ok=True,
            seconds_to_ready=launch.seconds_to_ready,
            kv_cache_tokens=kv,
            predicted_kv_tokens=plan_kv,
            kv_tokens_error_pct=round(100 * (plan_kv - kv) / kv, 3) if kv and plan_kv else None,
            weights_gib=launch.values.model_memory_gib,
            timeline=launch.timeline,
        )


class LaunchRecord(Record):
    """The server a run uses: the exact configuration it was launched with, how it loaded, what vLLM logged."""

    FILE = "03_launch"

    config: server.ServerConfig  # what the A/B relaunches and deploy turns into a unit

    @model_validator(mode="before")
    @classmethod
    def _layout_as_one(cls, data: Any) -> Any:
        """Records of schema 2 held the layout's four fields in the configuration; they are one layout now."""
        config = data.get("config") if isinstance(data, dict) else None
        if isinstance(config, dict) and "layout" not in config and any(n in config for n in serving.LAYOUT):
            config["layout"] = Parallelism().updated({n: config.pop(n) for n in serving.LAYOUT if n in config})
        if isinstance(data, dict) and "topology" not in data:  # schema 2: the shape from what it started
            roles = [w.get("role", "") if isinstance(w, dict) else w.role for w in data.get("workers") or []]
            data["topology"] = topology.shape_of_launch(bool(data.get("router")), roles)
        return data

    layout_source: Literal["plan", "explorer", "params", "rehearsal"] = "params"
    command: list[str]  # secrets masked
    command_line: str
    environment: dict[str, str]  # what differs from the launching shell, secrets masked
    fingerprint: str
    load_budget_s: float
    pid: int = 0
    pgid: int = 0
    reused: bool = False
    started_by_this_run: bool = False
    log_path: str = ""
    seconds_to_ready: float = 0.0
    phases: dict[str, float] = {}  # phase -> seconds since the process started
    vllm_reported: LogValues = LogValues()
    preflight: server.Preflight | None = None
    memory_after_load: MemoryAfterLoad = MemoryAfterLoad()
    plan_check: PlanCheck | None = None
    nodes: list[multinode.NodeProbe] = []  # what each node had before a multi-node launch, head first
    workers: list[remote.WorkerRecord] = []  # the other nodes' vLLM processes
    timeline: startup.Timeline | None = None  # where the start's time went, phase by phase
    start_prediction: startup.StartPrediction | None = None  # what the plan expected of this start
    load_choice: loadpath.LoadChoice | None = None  # the load options the launch took, and why
    dry_run: DryStart | None = None  # the dummy-weights start before this one (launch_dry_run)
    rehearsal_check: RehearsalCheck | None = None  # this server against its rehearsal, where one rehearsed it
    # replicas > 1: every replica (the first is the one the fields above describe) and the router in front
    replicas: list[ReplicaRecord] = []
    router: RouterRecord | None = None
    topology: Shape = "single"  # the serving shape it launched (topology.shape_of)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def url(self) -> str:
        """Where clients go: the router where there are replicas, else the server."""
        return self.router.url if self.router else self.config.url

    def require_answering(self, needed_by: str) -> None:
        """One line instead of a connection traceback when the server this record describes is gone."""
        state = client.health(self.url, timeout=5.0)
        if state != "ready":
            raise PreflightError(
                f"{needed_by} needs the server in {self.FILE}.json, and {self.url} does not answer /health ({state}); "
                f"run 03_launch (servebook run PARAMS --stages launch,{needed_by}), or `servebook status` to see why"
            )

    def target(self, timeout_s: float = 600.0) -> client.Target:
        """Where a stage sends requests, with the server's key; behind a router, its replicas' own /metrics."""
        own = self.config.target(timeout_s)
        if not self.router:
            return own
        return dataclasses.replace(
            own,
            url=self.router.url,
            engines=tuple(r.url for r in self.replicas),
            router_metrics=self.router.metrics_url,
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def layout(self) -> Parallelism:
        return self.config.layout

    @computed_field  # type: ignore[prop-decorator]
    @property
    def gpu_ids(self) -> list[int]:
        """The physical GPUs the server (every replica) uses (none on the CPU)."""
        return [g for r in self.replicas for g in r.gpu_ids] if self.replicas else self.config.target_gpus

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    @property
    def model_path(self) -> str:
        return self.config.model_path

    @property
    def api_key_env(self) -> str:
        return self.config.api_key_env

    @classmethod
    def planned(cls, cfg: server.ServerConfig) -> LaunchRecord:
        """The record of a configuration not launched here (a unit for another host): command and environment only."""
        command = [mask(a) for a in cfg.command()]
        return cls(
            config=cfg,
            command=command,
            command_line=subprocess.list2cmdline(command),
            environment=mask_env(cfg.environment(base={}, with_secrets=False)),
            fingerprint=cfg.fingerprint(),
            load_budget_s=cfg.load_budget_s(),
        )

    @classmethod
    def of(cls, launch: server.Launch, **extra: object) -> LaunchRecord:
        command = [mask(a) for a in launch.command]
        return cls(
            config=launch.config,
            command=command,
            command_line=mask(subprocess.list2cmdline(launch.command)),
            environment=launch.environment,
            fingerprint=launch.config.fingerprint(),
            load_budget_s=launch.config.load_budget_s(),
            pid=launch.pid,
            pgid=launch.pgid,
            reused=launch.reused,
            started_by_this_run=launch.started_by_this_run,
            log_path=launch.log_path,
            seconds_to_ready=launch.seconds_to_ready,
            phases=launch.phases,
            vllm_reported=launch.values,
            preflight=launch.preflight,
            **extra,
        )


# ---------------------------------------------------------------- 04 smoke test


class SmokeTestRecord(Record, client.SmokeResult):
    FILE = "04_smoke_test"


# ---------------------------------------------------------------- 05 benchmark


class BenchmarkRecord(Record, bench.SweepResult):
    FILE = "05_benchmark"

    rates: ratesweep.RateSweepResult | None = None  # the open-loop sweep, where bench_request_rates asked for one
    dataset: str = ""  # what the dataset's requests were, where bench_dataset named one; empty: synthetic
    against_rehearsal: str = ""  # the real server's levels beside its rehearsal's, at the same concurrency


# ---------------------------------------------------------------- 06 NCCL tuning


class NcclTuningRecord(Record):
    FILE = "06_nccl_tuning"

    micro: nccl.MicroResult
    ab: ab.AbResult | None  # on the real weights: every variant, or (ab_on_dummy) the dummy A/B's winner alone
    rehearsed: RehearsedAb | None = None  # ab_on_dummy: every variant on dummy weights first
    recommended_env: dict[str, str]  # the environment to deploy with; empty means the default
    recommendation: str
    notes: list[str]


# ---------------------------------------------------------------- 07 deploy


class Command(BaseModel):
    """A command servebook ran as the service would, and what it said."""

    command: str
    returncode: int
    output: str
    seconds: float | None = None


class DryRun(BaseModel):
    """What systemd would do, done by hand: pre-start check, the exact ExecStart, post-start wait, smoke test."""

    pre_start: Command
    skipped: str = ""
    post_start: Command | None = None
    smoke_test: client.SmokeResult | None = None
    # a keyed unit: what a request without the key got (401 when the unit's environment file holds the key)
    keyless_status: int | None = None
    stop: server.Terminated | None = None
    log: str = ""


class NodeUnitRecord(BaseModel):
    """A worker node's unit of a multi-node server, for ``systemctl`` on that node."""

    node: str
    unit_name: str
    unit_file: str
    verify: systemd.Verified


class DeployRecord(Record):
    FILE = "07_deploy"

    unit_name: str
    unit_file: str
    env_file: str
    timeout_start_s: int
    load_seconds: float
    load_source: Literal["measured", "predicted"]
    start_limit_interval_s: int
    verify: systemd.Verified
    systemd_running: bool
    pre_start_with_ad_hoc_server: Command
    ad_hoc_server_stopped: str = ""
    installed: systemd.Installed | None = None
    service_ready: str = ""
    smoke_test: client.SmokeResult | None = None
    dry_run: DryRun | None = None
    dry_run_skipped: str = ""
    node_units: list[NodeUnitRecord] = []  # a multi-node server's other nodes, started by the head's unit
    replica_units: list[NodeUnitRecord] = []  # behind a router: each replica's unit, which the router's requires
    run_as: str = ""  # the user the dry run ran as: the unit's where it exists here
    access_problems: list[str] = []  # what the unit's user could not read or run, each with the fix
    warnings: list[str] = []  # what the unit left out of the launch's environment, and why
    watchdog_files: list[str] = []  # the liveness check's service and timer, beside the unit
    watchdog_verify: systemd.Verified | None = None
