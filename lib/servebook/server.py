"""Launch, watch, reuse and stop vLLM servers, leaving nothing behind.

Every server runs in its own session (process group) with its log in the run
folder, and is recorded in a registry under the servebook cache so that
``servebook status`` and ``servebook stop`` find it from any shell.  vLLM renames
its processes ``VLLM::APIServer``, ``VLLM::EngineCore``, ``VLLM::Worker_TP<n>``;
killing the API server with SIGKILL leaves the others alive, so a stop signals
the whole group and then looks for survivors by group and by title.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from servebook import hardware, models, vllm_compat
from servebook.errors import CleanupError, LaunchError, PreflightError
from servebook.models import cache_root
from servebook.results import mask, mask_env

VLLM_TITLE = "VLLM::"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
STOP_GRACE_S = 20.0  # vLLM's worker shutdown timeout is 5 s; leave room for the engine and API server
SECONDS_PER_GB = 6.0  # load-budget slope: 547 GB took 36 minutes in the story
BASE_BUDGET_S = 300.0  # imports, torch.compile warm-up and graph capture on a small model


# ---------------------------------------------------------------- configuration

@dataclass
class ServerConfig:
    """Everything that determines a server's behaviour; its hash decides reuse."""

    model: str  # what the params named
    model_path: str  # what vLLM loads
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_ids: list[int] = field(default_factory=list)
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    cpu_kv_cache_gib: float = 1.0
    enforce_eager: bool = False
    max_num_seqs: int = 0
    api_key_env: str = ""
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    load_timeout_s: float = 0.0

    @classmethod
    def from_params(cls, values: dict[str, Any], device: str, layout: dict[str, Any] | None = None,
                    model_path: str | None = None) -> "ServerConfig":
        """Build from parameters; a plan's recommended layout overrides the layout keys, a download's folder the model."""
        keys = {f for f in cls.__dataclass_fields__ if f not in {"model_path", "device"}}
        chosen = {k: v for k, v in values.items() if k in keys}
        if layout:
            chosen.update({k: v for k, v in layout.items() if k in keys})
        model = chosen["model"]
        chosen["served_model_name"] = chosen.get("served_model_name") or models.default_served_name(model)
        return cls(model_path=model_path or models.resolve(model), device=device, **chosen)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def serve_args(self) -> list[str]:
        """vLLM flags after the model, in the order a person would write them."""
        args = ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
                "--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.data_parallel_size > 1:
            args += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.enable_expert_parallel:
            args.append("--enable-expert-parallel")
        if self.device == "cuda":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        return args + list(self.extra_args)

    def command(self) -> list[str]:
        return vllm_compat.serve_prefix(self.model_path) + self.serve_args()

    def checkpoint_gb(self) -> float:
        size, _ = models.checkpoint_bytes(self.model_path)
        return (size or 0) / 1e9

    def load_budget_s(self) -> float:
        if self.load_timeout_s:
            return float(self.load_timeout_s)
        return BASE_BUDGET_S + SECONDS_PER_GB * self.checkpoint_gb()

    def environment(self, base: dict[str, str] | None = None, with_secrets: bool = True) -> dict[str, str]:
        """The server's environment: ours, plus what vLLM needs, plus extra_env. The API key stays out of argv."""
        env = dict(os.environ if base is None else base)
        # The launcher must not cut a long load short: vLLM's own default is 600 s.
        env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(self.load_budget_s()))
        # Jupyter kernels advertise colour; a log file wants plain text.
        env["VLLM_LOGGING_COLOR"] = "0"
        env["NO_COLOR"] = "1"
        env.pop("FORCE_COLOR", None)
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.cpu_kv_cache_gib)))
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        elif self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        env.pop("VLLM_API_KEY", None)
        if self.api_key_env and with_secrets:
            if self.api_key_env not in os.environ:
                raise PreflightError(f"api_key_env names {self.api_key_env}, which is not set; export it or set api_key_env: ''")
            env["VLLM_API_KEY"] = os.environ[self.api_key_env]
        env.update(self.extra_env)
        return env

    def fingerprint(self) -> str:
        data = asdict(self)
        data.pop("load_timeout_s")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


# ---------------------------------------------------------------- registry

def registry_dir() -> Path:
    path = cache_root() / "servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _registry_path(port: int) -> Path:
    return registry_dir() / f"{port}.json"


def registered(port: int) -> dict[str, Any] | None:
    path = _registry_path(port)
    return json.loads(path.read_text()) if path.is_file() else None


def all_registered() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(registry_dir().glob("*.json"))]


def _register(record: dict[str, Any]) -> None:
    _registry_path(record["port"]).write_text(json.dumps(record, indent=2))


def _unregister(port: int) -> None:
    _registry_path(port).unlink(missing_ok=True)


# ---------------------------------------------------------------- processes

def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()).strip() or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return members


def vllm_orphans() -> list[psutil.Process]:
    """``VLLM::`` processes whose launcher is gone (re-parented to init or a subreaper)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if _title(proc).startswith(VLLM_TITLE) and hardware.is_orphan(proc.pid):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} '{_title(proc)[:80]}' (user {proc.username()})"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {proc.pid}"


def port_holder(host: str, port: int) -> psutil.Process | None | bool:
    """The process listening on the port, True when something listens but cannot be named, None when free."""
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.laddr.ip in (host, "0.0.0.0", "::", "127.0.0.1", "::1") or host in ("0.0.0.0", "::"):
                if conn.pid:
                    try:
                        return psutil.Process(conn.pid)
                    except psutil.NoSuchProcess:
                        continue
                return True
    return None


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def terminate(pgid: int | None, extra: list[psutil.Process] = (), grace_s: float = STOP_GRACE_S) -> dict[str, Any]:
    """SIGTERM our group (and extra processes), wait, SIGKILL what remains, and say what happened.

    ``pgid`` is only ever a group servebook created; processes found by title are
    signalled one by one, never through a group they may share with a shell.
    """
    start = time.monotonic()
    targets = {p.pid: p for p in [*(group_members(pgid) if pgid else []), *extra]}
    described = [describe(p) for p in targets.values()]
    if pgid:
        _signal_group(pgid, signal.SIGTERM)
    _signal(list(extra), signal.SIGTERM)
    alive = _wait_gone(list(targets.values()), grace_s)
    killed = [describe(p) for p in alive]
    if alive:
        if pgid:
            _signal_group(pgid, signal.SIGKILL)
        _signal(alive, signal.SIGKILL)
        alive = _wait_gone(alive, 10)
    late = group_members(pgid) if pgid else []  # a child forked during shutdown
    if late:
        _signal(late, signal.SIGKILL)
        alive += _wait_gone(late, 5)
    return {
        "signalled": described,
        "killed_after_grace": killed,
        "remaining": [describe(p) for p in alive],
        "seconds": round(time.monotonic() - start, 2),
    }


# ---------------------------------------------------------------- health

def health(url: str, timeout: float = 2.0) -> str:
    """'ready' (200), 'dead' (503: the engine died), 'loading' (no listener yet) or 'error <code>'."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return "loading"
    except httpx.TimeoutException:
        return "busy"
    if r.status_code == 200:
        return "ready"
    if r.status_code == 503:
        return "dead"
    return f"error {r.status_code}"


# ---------------------------------------------------------------- log parsing

PHASES: list[tuple[str, re.Pattern[str]]] = [
    ("version", re.compile(r"(?:vLLM (?:server |API server )?version|█ +version) (\d[\w.+\-]*)")),
    ("loading_model", re.compile(r"Starting to load model (\S+)")),
    ("shards", re.compile(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \|\s*(\d+)/(\d+)")),
    ("weights_loaded", re.compile(r"Loading weights took ([\d.]+) seconds")),
    ("model_loaded", re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")),
    ("kv_memory", re.compile(r"Available KV cache memory: ([\d.]+) GiB")),
    ("kv_cache", re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")),
    ("max_concurrency", re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")),
    ("graph_capture", re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.\-]+) GiB")),
    ("engine_init", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")),
    ("api_up", re.compile(r"Application startup complete")),
]

ROOT_CAUSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"error: (unrecognized arguments: .*|argument .*|ambiguous option: .*)"), "bad command-line flag"),
    (re.compile(r"((?:The |Weight )\S.* is not divisible by weight quantization block_[nk] = \d+.*)"), "FP8 block alignment: choose a layout from the plan whose shards are multiples of the block"),
    (re.compile(r"((?:CUDA|torch\.OutOfMemoryError|OutOfMemoryError).*out of memory.*)", re.I), "out of GPU memory: lower max_model_len or gpu_memory_utilization, or use more GPUs"),
    (re.compile(r"(No available memory for the cache blocks.*|insufficient .*KV cache.*)", re.I), "no memory left for the KV cache"),
    (re.compile(r"(\S*maximum .*context length.*larger than.*KV cache.*)", re.I), "max_model_len does not fit the KV cache"),
    (re.compile(r"(Address already in use.*|\[Errno 98\].*)"), "port already in use"),
    (re.compile(r"(Total number of attention heads .* must be divisible by tensor parallel size .*)"), "tensor_parallel_size does not divide the attention heads"),
    # the last line of a traceback: an exception name at the start, after vLLM's "(EngineCore pid=N)" prefix
    (re.compile(r"^(?:\(\S+ pid=\d+\)\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)"), "exception while starting"),
    (re.compile(r"(Illegal instruction.*)"), "the CPU lacks an instruction set this vLLM build needs"),
]


@dataclass
class LoadProgress:
    """What the log has said so far, with the time (seconds since start) each phase was seen."""

    seen: dict[str, float] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def feed(self, line: str, elapsed: float) -> str | None:
        """Digest one log line; return a short description when it marks progress."""
        said = [s for name, pattern in PHASES if (m := pattern.search(line)) for s in [self._note(name, m, elapsed)] if s]
        return "; ".join(said) or None

    def _note(self, name: str, m: re.Match[str], elapsed: float) -> str:
        first = name not in self.seen
        if first or name == "shards":  # shards advance; other phases keep their first sighting
            self.seen[name] = round(elapsed, 2)
        values, message = _PHASE_READERS[name](m.groups())
        self.values.update(values)
        return message if first or name == "shards" else ""


def _num(text: str) -> int:
    return int(text.replace(",", ""))


# phase -> (values to record, progress message), from the regex groups
_PHASE_READERS: dict[str, Callable[[tuple[str, ...]], tuple[dict[str, Any], str]]] = {
    "version": lambda g: ({"vllm_version": g[0]}, f"vLLM {g[0]} starting"),
    "loading_model": lambda g: ({}, "loading model"),
    "shards": lambda g: ({"shards_percent": int(g[0])}, f"checkpoint shards {g[0]}% ({g[1]}/{g[2]})"),
    "weights_loaded": lambda g: ({"weights_load_s": float(g[0])}, f"weights loaded in {g[0]} s"),
    "model_loaded": lambda g: ({"model_memory_gib": float(g[0]), "model_load_s": float(g[1])},
                               f"model loaded: {g[0]} GiB in {float(g[1]):.1f} s"),
    "kv_memory": lambda g: ({"kv_cache_memory_gib": float(g[0])}, f"KV cache memory {g[0]} GiB"),
    "kv_cache": lambda g: ({"kv_cache_device": g[0], "kv_cache_tokens": _num(g[1])}, f"KV cache: {g[1]} tokens"),
    "max_concurrency": lambda g: ({"max_concurrency_context": _num(g[0]), "max_concurrency": float(g[1])},
                                  f"maximum concurrency {g[1]}x at {g[0]} tokens per request"),
    "graph_capture": lambda g: ({"graph_capture_s": float(g[0]), "graph_memory_gib": float(g[1])}, f"graphs captured in {g[0]} s"),
    "engine_init": lambda g: ({"engine_init_s": float(g[0])}, f"engine initialised in {g[0]} s"),
    "api_up": lambda g: ({}, "API server up"),
}


def root_cause(log_text: str) -> str:
    """The most telling error line in a server log, with what it means."""
    # vLLM's closing "Engine core initialization failed. See root cause above." points elsewhere
    lines = [l for l in ANSI_ESCAPE.sub("", log_text).splitlines() if "See root cause above" not in l]
    for pattern, meaning in ROOT_CAUSES:
        for i in range(len(lines) - 1, -1, -1):
            m = pattern.search(lines[i])
            if m:
                text = m.group(1).strip()
                if "validation error for" in text:  # pydantic puts the reason on the following lines
                    detail = [l.strip() for l in lines[i + 1:i + 4] if l.strip() and "For further information" not in l]
                    text = " ".join([text, *detail[:2]]).replace("Value error, ", "")
                return f"{meaning}: {text[:600]}"
    return "the server exited without a recognised error; read the log tail"


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return mask("\n".join(ANSI_ESCAPE.sub("", text).splitlines()[-lines:]))


# ---------------------------------------------------------------- preflight

def preflight(cfg: ServerConfig, stop_leftovers: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Checks before any process starts. Returns {'reuse': record} when a matching server is healthy."""
    report: dict[str, Any] = {"reuse": None, "stopped": []}
    start = time.monotonic()
    parsed = vllm_compat.parse_serve_args(cfg.model_path, cfg.serve_args())
    report["parse_seconds"] = round(parsed.seconds, 2)
    if not parsed.ok:
        raise PreflightError(
            f"vLLM {vllm_compat.vllm_version()} rejects the serving command (found in {parsed.seconds:.1f} s, nothing started):\n"
            f"{parsed.message}\nfix extra_args (or the parameter that produced the flag) and launch again"
        )
    env_problems = vllm_compat.unknown_vllm_env(list(cfg.extra_env), parsed.known_env)
    if env_problems:
        raise PreflightError("unknown vLLM environment variables, nothing started:\n  - " + "\n  - ".join(env_problems))

    record = registered(cfg.port)
    holder = port_holder(cfg.host, cfg.port)
    ours = record is not None and holder not in (None, True) and _same_group(holder, record.get("pgid"))
    if holder is not None:
        if ours and record["fingerprint"] == cfg.fingerprint() and health(record["url"]) == "ready":
            log(f"reusing the healthy server on port {cfg.port} (pid {record['pid']}) launched with the same configuration")
            report["reuse"] = record
            return report
        if ours and stop_leftovers:
            log(f"stopping our earlier server on port {cfg.port} (different configuration or unhealthy)")
            report["stopped"].append(stop(port=cfg.port))
        elif ours:
            raise PreflightError(
                f"port {cfg.port} is held by a servebook server with a different configuration (pid {record['pid']}); "
                f"stop it with `servebook stop --port {cfg.port}` or set stop_leftovers: true"
            )
        else:
            who = "an unidentified process (run as root to see it)" if holder is True else describe(holder)
            raise PreflightError(f"port {cfg.port} on {cfg.host} is held by {who}; choose another port or stop that process")

    orphans = vllm_orphans()
    if orphans:
        names = "; ".join(describe(p) for p in orphans)
        if not stop_leftovers:
            raise PreflightError(
                f"orphaned vLLM processes from an earlier server are still running: {names}. "
                "They hold memory the new server needs; run `servebook stop --orphans` or set stop_leftovers: true"
            )
        log(f"stopping orphaned vLLM processes: {names}")
        report["stopped"].append(terminate(None, extra=orphans))

    if cfg.device == "cuda":
        report["gpu_holders"] = _check_gpus(cfg, stop_leftovers, log)
    report["seconds"] = round(time.monotonic() - start, 2)
    return report


def _same_group(proc: psutil.Process, pgid: int | None) -> bool:
    try:
        return pgid is not None and os.getpgid(proc.pid) == pgid
    except ProcessLookupError:
        return False


def _check_gpus(cfg: ServerConfig, stop_leftovers: bool, log: Callable[[str], None]) -> list[str]:
    inv = hardware.inventory()
    if not inv.available:
        raise PreflightError(f"device is cuda but {inv.error}")
    targets = cfg.gpu_ids or [g.index for g in inv.gpus[: cfg.world_size]]
    held = hardware.holders(inv, targets)
    foreign = [(i, p) for i, p in held if not p.is_vllm]
    leftovers = [(i, p) for i, p in held if p.is_vllm]
    lines = [f"GPU {i}: pid {p.pid} {p.title} {hardware.gib(p.used_bytes)}" for i, p in held]
    if foreign:
        raise PreflightError("target GPUs are held by processes that are not vLLM's; servebook will not touch them:\n  "
                             + "\n  ".join(lines) + "\nstop them yourself or choose other gpu_ids")
    if leftovers and not stop_leftovers:
        raise PreflightError("target GPUs are held by leftover vLLM processes:\n  " + "\n  ".join(lines)
                             + "\nrun `servebook stop --orphans` or set stop_leftovers: true")
    for i, p in leftovers:
        log(f"stopping leftover vLLM process on GPU {i}: pid {p.pid} {p.title}")
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(p.pid).terminate()
    invisible = [g for g in inv.gpus if g.index in targets and g.unattributed_bytes]
    if invisible:
        raise PreflightError("target GPUs hold memory no visible process accounts for: "
                             + ", ".join(f"GPU {g.index} {hardware.gib(g.unattributed_bytes)}" for g in invisible)
                             + "; another container or user holds them")
    return lines


# ---------------------------------------------------------------- launch

@dataclass
class Launch:
    config: ServerConfig
    pid: int
    pgid: int
    url: str
    log_path: str
    reused: bool
    started_by_this_run: bool
    command: list[str]
    environment: dict[str, str]
    seconds_to_ready: float
    phases: dict[str, float]
    values: dict[str, Any]
    preflight: dict[str, Any]

    def results(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "host": self.config.host,
            "port": self.config.port,
            "served_model_name": self.config.served_model_name,
            "model": self.config.model,
            "model_path": self.config.model_path,
            "device": self.config.device,
            "gpu_ids": self.config.gpu_ids,
            "world_size": self.config.world_size,
            "pid": self.pid,
            "pgid": self.pgid,
            "reused": self.reused,
            "started_by_this_run": self.started_by_this_run,
            "command": [mask(a) for a in self.command],
            "command_line": mask(subprocess.list2cmdline(self.command)),
            "environment": self.environment,
            "log_path": self.log_path,
            "seconds_to_ready": self.seconds_to_ready,
            "phases": self.phases,
            "vllm_reported": self.values,
            "preflight": self.preflight,
            "fingerprint": self.config.fingerprint(),
            "api_key_env": self.config.api_key_env,
        }


def _server_env_record(cfg: ServerConfig, env: dict[str, str]) -> dict[str, str]:
    """The variables that differ from the launching shell (what a unit file would need), secrets masked."""
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v or k in cfg.extra_env}
    return mask_env(changed)


def launch(
    cfg: ServerConfig,
    log_dir: str | Path,
    stop_leftovers: bool = False,
    on_progress: Callable[[str, float], None] | None = None,
    log: Callable[[str], None] = print,
) -> Launch:
    """Preflight, start, and wait for ``/health``; raise :class:`LaunchError` with the root cause on failure."""
    pre = preflight(cfg, stop_leftovers=stop_leftovers, log=log)
    env = cfg.environment()
    if pre["reuse"]:
        rec = pre["reuse"]
        return Launch(cfg, rec["pid"], rec["pgid"], rec["url"], rec["log_path"], True, False, rec["command"],
                      _server_env_record(cfg, env), 0.0, {}, rec.get("values", {}), pre)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "server.log"
    if log_path.exists():  # never overwrite an earlier server's log
        log_path = log_dir / f"server-{datetime.now().strftime('%H%M%S')}.log"
    command = cfg.command()
    budget = cfg.load_budget_s()
    log(f"starting vLLM ({'module entry point' if '-m' in command else 'console script'}), load budget {budget:.0f} s, log {log_path}")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pgid = proc.pid  # start_new_session makes the child a group leader
    record = {"pid": proc.pid, "pgid": pgid, "port": cfg.port, "host": cfg.host, "url": cfg.url,
              "fingerprint": cfg.fingerprint(), "command": [mask(a) for a in command], "log_path": str(log_path),
              "model": cfg.model, "served_model_name": cfg.served_model_name, "device": cfg.device,
              "gpu_ids": cfg.gpu_ids, "started_at": datetime.now(timezone.utc).isoformat()}
    _register(record)
    try:
        phases, values, seconds = _wait_ready(proc, cfg, log_path, budget, on_progress)
    except BaseException:
        stop(port=cfg.port)
        raise
    record["values"] = values
    _register(record)
    return Launch(cfg, proc.pid, pgid, cfg.url, str(log_path), False, True, command,
                  _server_env_record(cfg, env), seconds, phases, values, pre)


def _wait_ready(proc: subprocess.Popen, cfg: ServerConfig, log_path: Path, budget: float,
                on_progress: Callable[[str, float], None] | None) -> tuple[dict[str, float], dict[str, Any], float]:
    start = time.monotonic()
    progress = LoadProgress()
    offset = 0
    pending = ""
    while True:
        elapsed = time.monotonic() - start
        with open(log_path, errors="replace") as fh:
            fh.seek(offset)
            chunk = fh.read()
            offset = fh.tell()
        pending += chunk.replace("\r", "\n")
        *complete, pending = pending.split("\n")
        for line in complete:
            said = progress.feed(ANSI_ESCAPE.sub("", line), elapsed)
            if said and on_progress:
                on_progress(said, elapsed)
        code = proc.poll()
        if code is not None:
            text = log_path.read_text(errors="replace")
            raise LaunchError(f"vLLM exited with code {code} after {elapsed:.1f} s, before it was ready",
                              cause=mask(root_cause(text)), log_tail=tail(log_path), log_path=str(log_path))
        state = health(cfg.url)
        if state == "ready":
            progress.seen["ready"] = round(elapsed, 2)
            if on_progress:
                on_progress("ready: /health answers 200", elapsed)
            return progress.seen, progress.values, round(elapsed, 2)
        if state == "dead":
            text = log_path.read_text(errors="replace")
            raise LaunchError("vLLM's /health reports the engine dead", cause=mask(root_cause(text)),
                              log_tail=tail(log_path), log_path=str(log_path))
        if elapsed > budget:
            raise LaunchError(f"vLLM was not ready within the load budget of {budget:.0f} s; raise load_timeout_s if the load is "
                              "simply slow", cause="timeout", log_tail=tail(log_path), log_path=str(log_path))
        time.sleep(0.5)


# ---------------------------------------------------------------- stop and status

def stop(port: int | None = None, host: str = "127.0.0.1", orphans: bool = False, grace_s: float = STOP_GRACE_S) -> dict[str, Any]:
    """Stop the registered server on a port (or every registered one), and with ``orphans`` also every
    orphaned ``VLLM::`` process on the host; then verify nothing of theirs is left."""
    records = [r for r in ([registered(port)] if port is not None else all_registered()) if r]
    outcome: dict[str, Any] = {"servers": [], "orphans": None, "remaining": []}
    for rec in records:
        result = terminate(rec["pgid"], grace_s=grace_s)
        result["port"] = rec["port"]
        outcome["servers"].append(result)
        outcome["remaining"] += result["remaining"]
        if not result["remaining"]:
            _unregister(rec["port"])
    if orphans:
        found = vllm_orphans()
        if found:
            outcome["orphans"] = terminate(None, extra=found, grace_s=grace_s)
            outcome["remaining"] += outcome["orphans"]["remaining"]
    if orphans:
        outcome["remaining"] += [describe(p) for p in vllm_orphans() if describe(p) not in outcome["remaining"]]
    gpu_left = _gpu_leftovers(records)
    outcome["gpu_holders"] = gpu_left
    stopped = sum(len(s["signalled"]) for s in outcome["servers"]) + (len(outcome["orphans"]["signalled"]) if outcome["orphans"] else 0)
    outcome["summary"] = (f"{stopped} process(es) stopped, nothing left" if not outcome["remaining"] and not gpu_left
                          else f"left behind: {outcome['remaining'] + gpu_left}")
    if outcome["remaining"] or gpu_left:
        raise CleanupError(f"processes survived the stop: {outcome['remaining'] + gpu_left}")
    return outcome


def _gpu_leftovers(records: list[dict[str, Any]]) -> list[str]:
    """vLLM processes still on the GPUs our servers used (none on CPU hosts)."""
    if not any(r.get("device") == "cuda" for r in records):
        return []
    inv = hardware.inventory()
    if not inv.available:
        return []
    return [f"GPU {i}: pid {p.pid} {p.title}" for i, p in hardware.holders(inv) if p.is_vllm]


def status() -> list[dict[str, Any]]:
    """Every registered server with its liveness and health, plus orphaned vLLM processes."""
    rows = []
    for rec in all_registered():
        members = group_members(rec["pgid"])
        rows.append({"port": rec["port"], "pid": rec["pid"], "model": rec["model"], "url": rec["url"],
                     "processes": len(members), "health": health(rec["url"]) if members else "stopped",
                     "log": rec["log_path"], "started_at": rec["started_at"]})
    for proc in vllm_orphans():
        rows.append({"port": None, "pid": proc.pid, "model": "?", "url": "", "processes": 1,
                     "health": "orphaned", "log": "", "started_at": ""})
    return rows


# ---------------------------------------------------------------- checks for a service manager

def resources_held(port: int, host: str = "127.0.0.1", gpu_ids: list[int] | None = None) -> list[str]:
    """Everything that would stop a new server from starting: a port holder, orphaned vLLM processes,
    processes or unattributed memory on the GPUs."""
    problems = []
    holder = port_holder(host, port)
    if holder is not None:
        problems.append(f"port {port} is held by {'an unidentified process' if holder is True else describe(holder)}")
    problems += [f"orphaned vLLM process {describe(p)}" for p in vllm_orphans()]
    if gpu_ids:
        inv = hardware.inventory()
        if not inv.available:
            problems.append(f"GPUs {gpu_ids} requested but {inv.error}")
        else:
            for i, p in hardware.holders(inv, gpu_ids):
                problems.append(f"GPU {i} holds {hardware.gib(p.used_bytes)} for pid {p.pid} {p.title}")
            problems += [f"GPU {g.index} has {hardware.gib(g.unattributed_bytes)} in use by no visible process"
                         for g in inv.gpus if g.index in gpu_ids and g.unattributed_bytes]
    return problems


def wait_ready(url: str, timeout_s: float, poll_s: float = 2.0) -> tuple[bool, str, float]:
    """Poll ``/health`` until 200 (ready), 503 (engine dead) or the timeout; (ok, what happened, seconds)."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        state = health(url)
        if state == "ready":
            return True, f"{url} ready after {elapsed:.1f} s", elapsed
        if state == "dead":
            return False, f"{url}/health answers 503: the engine died", elapsed
        if elapsed >= timeout_s:
            return False, f"{url} not ready within {timeout_s:.0f} s (last state: {state})", elapsed
        time.sleep(min(poll_s, max(0.1, timeout_s - elapsed)))
