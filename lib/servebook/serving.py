"""The serving fields, declared once: each one's params name, vLLM flags, type, vLLM's own default per version,
the plan input it is, whether vLLM's compile cache keys on it, and how a server's command line writes it.

Readers: params validation (``extra_args`` that would set an owned flag is refused before anything starts),
:meth:`servebook.server_config.ServerConfig.serve_args` (the command the plan prints, the launch runs and a unit
file carries), ``ServerConfig.from_params``, the A/B's variants, the compile-cache key (:mod:`servebook.startup`)
and the plan's what-if (which fields are plan inputs). The four layout fields travel as one
:class:`~servebook.planner.Parallelism`: their row writes the whole layout through ``Parallelism.flags``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from servebook import vllm_defaults
from servebook.planner import Parallelism

PlanInput = Literal["layout", "context", "kv_cache", "batch", "load", "nodes", ""]


class Config(Protocol):
    """What a row's writer reads of a server's configuration (``ServerConfig``)."""

    device: str
    nodes: int
    layout: Parallelism


Writer = Callable[[Any, Config], list[str]]


@dataclass(frozen=True)
class ServingField:
    """One serving field. ``flags``: vLLM's spellings of it, the one servebook writes first (``extra_args`` may
    set none of them); ``write``: the flags for a value (nothing where vLLM's default holds); ``vllm_default``:
    vLLM's own default per version prefix, where servebook knows it."""

    name: str
    kind: type
    flags: tuple[str, ...] = ()
    write: Writer | None = None
    plan_input: PlanInput = ""
    compile_key: bool = False
    vllm_default: Mapping[str, Any] = field(default_factory=dict)
    how: str = ""  # how the server gets it when no flag carries it


def _always(flag: str) -> Writer:
    return lambda value, _cfg: [flag, str(value)]


def _unless(flag: str, *defaults: Any) -> Writer:
    """The flag with its value, unless the value leaves vLLM's own default in place."""
    return lambda value, _cfg: [] if value in defaults else [flag, str(value)]


def _switch(flag: str) -> Writer:
    return lambda value, _cfg: [flag] if value else []


def _layout(_value: Any, cfg: Config) -> list[str]:
    return cfg.layout.flags()


def _on_gpus(flag: str) -> Writer:
    return lambda value, cfg: [flag, str(value)] if cfg.device == "cuda" else []


def _ep_weight_filter(value: Any, cfg: Config) -> list[str]:
    return ["--enable-ep-weight-filter"] if value == "on" and cfg.layout.ep else []


def _backend(value: Any, cfg: Config) -> list[str]:
    """Ray across nodes: vLLM's executor places the workers on the cluster and launches every data-parallel rank
    from this one command; mp needs no flag (it is vLLM's default)."""
    if value != "ray" or cfg.nodes <= 1:
        return []
    return ["--distributed-executor-backend", "ray"] + (["--data-parallel-backend", "ray"] if cfg.layout.dp > 1 else [])


LAYOUT = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel")
ON_VLLM_DEFAULT = {v: row.gpu_memory_utilization for v, row in vllm_defaults.TABLE.items()}

# in the order a person writes them after the model; rows without a writer reach vLLM another way (``how``)
FIELDS: tuple[ServingField, ...] = (
    ServingField("model", str, how="the positional model argument (the download's folder where one ran)"),
    ServingField("served_model_name", str, ("--served-model-name",), _always("--served-model-name")),
    ServingField("host", str, ("--host",), _always("--host")),
    ServingField("port", int, ("--port",), _always("--port")),
    ServingField("max_model_len", int, ("--max-model-len",), _always("--max-model-len"), "context", True),
    ServingField("tensor_parallel_size", int, ("--tensor-parallel-size", "-tp"), _layout, "layout", True,
                 {"0.25": 1, "0.32": 1}),
    ServingField("pipeline_parallel_size", int, ("--pipeline-parallel-size", "-pp"), None, "layout", True,
                 {"0.25": 1, "0.32": 1}, how="tensor_parallel_size's row writes the whole layout"),
    ServingField("data_parallel_size", int, ("--data-parallel-size", "-dp"), None, "layout", True,
                 {"0.25": 1, "0.32": 1}, how="tensor_parallel_size's row writes the whole layout"),
    ServingField("enable_expert_parallel", bool, ("--enable-expert-parallel",), None, "layout", True,
                 {"0.25": False, "0.32": False}, how="tensor_parallel_size's row writes the whole layout"),
    ServingField("gpu_memory_utilization", float, ("--gpu-memory-utilization",),
                 _on_gpus("--gpu-memory-utilization"), "kv_cache", False, ON_VLLM_DEFAULT),
    ServingField("kv_cache_dtype", str, ("--kv-cache-dtype",), _unless("--kv-cache-dtype", "auto"), "kv_cache", True,
                 {"0.25": "auto", "0.32": "auto"}),
    ServingField("enforce_eager", bool, ("--enforce-eager",), _switch("--enforce-eager"), "kv_cache", True,
                 {"0.25": False, "0.32": False}),
    ServingField("max_num_seqs", int, ("--max-num-seqs",), _unless("--max-num-seqs", 0), "batch", True),
    ServingField("max_num_batched_tokens", int, ("--max-num-batched-tokens",),
                 _unless("--max-num-batched-tokens", 0), "batch", True),
    ServingField("load_format", str, ("--load-format",), _unless("--load-format", "auto", ""), "load"),
    ServingField("load_strategy", str, ("--safetensors-load-strategy",),
                 _unless("--safetensors-load-strategy", "auto", "default", ""), "load"),
    ServingField("ep_weight_filter", str, ("--enable-ep-weight-filter", "--no-enable-ep-weight-filter"),
                 _ep_weight_filter, "load"),
    ServingField("distributed_backend", str, ("--distributed-executor-backend", "--data-parallel-backend"),
                 _backend, "nodes"),
    ServingField("data_parallel_lb", str, ("--data-parallel-hybrid-lb",), None, "nodes",
                 how="multinode.node_flags, per node"),
    ServingField("nodes", int, ("--nnodes", "--node-rank", "--headless"), None, "nodes",
                 how="multinode.node_flags, per node (and the backend's flags above)"),
    ServingField("gpu_ids", list, how="CUDA_VISIBLE_DEVICES (with CUDA_DEVICE_ORDER=PCI_BUS_ID)"),
    ServingField("cpu_kv_cache_gib", float, plan_input="kv_cache", how="VLLM_CPU_KVCACHE_SPACE"),
    ServingField("api_key_env", str, how="VLLM_API_KEY in the server's environment, never on its command line"),
    ServingField("extra_args", list, how="appended after every owned flag", compile_key=True),
    ServingField("extra_env", dict, how="the server's environment, last"),
    ServingField("load_timeout_s", float, how="VLLM_ENGINE_READY_TIMEOUT_S, and the launch's load budget"),
)  # fmt: skip
BY_NAME = {f.name: f for f in FIELDS}
OWNED_FLAGS = {flag: f.name for f in FIELDS for flag in f.flags}
# vLLM's compile-cache key (model config, parallel config, batch limits, compilation config): what vLLM loads, and
# the rows that feed it; the memory share and the load options are outside it
COMPILE_KEY_FIELDS = ("model_path", *(f.name for f in FIELDS if f.compile_key))


def names() -> list[str]:
    return [f.name for f in FIELDS]


def value_of(config: Any, name: str) -> Any:
    """A serving field's value on anything that holds the fields (the params, or a configuration whose layout is one
    :class:`Parallelism`)."""
    layout = getattr(config, "layout", None)
    if name in LAYOUT and isinstance(layout, Parallelism):
        return layout.params()[name]
    return getattr(config, name, None)


def command_args(config: Config) -> list[str]:
    """The owned flags of a server's command line, in the table's order."""
    args: list[str] = []
    for f in FIELDS:
        if f.write is not None:
            args += f.write(value_of(config, f.name), config)
    return args


def conflicts(extra_args: Sequence[str]) -> list[str]:
    """Flags in ``extra_args`` that a parameter owns: vLLM takes the last one, so the plan, the launch lock and the
    unit would describe another server than the one that starts."""
    given = [a.split("=", 1)[0] for a in extra_args if a.startswith("-")]
    return [
        f"extra_args sets {flag}, which the parameter {OWNED_FLAGS[flag]} owns; set {OWNED_FLAGS[flag]} and take "
        f"{flag} out of extra_args"
        for flag in dict.fromkeys(given)
        if flag in OWNED_FLAGS
    ]


def _flags(args: Sequence[str]) -> dict[str, str]:
    """A command's flags and their values ('on' for a switch); the last of a repeated flag wins, as in vLLM."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else "--"
            value = "on" if following.startswith("--") else following
        found[flag] = value
    return found


def flag_changes(running: Sequence[str], asked: Sequence[str]) -> list[str]:
    """How the command asked for differs from the one running, flag by flag (``--max-model-len 1024 → 2048``)."""
    old, new = _flags(running), _flags(asked)
    return [
        f"{flag} {old.get(flag, 'unset')} → {new.get(flag, 'unset')}"
        for flag in dict.fromkeys([*old, *new])
        if old.get(flag) != new.get(flag)
    ]


def vllm_default(name: str, vllm_version: str | None) -> Any:
    """vLLM's own default for a field in that version (major.minor), or None where servebook does not know it."""
    known = BY_NAME[name].vllm_default
    if not vllm_version:
        return None
    return known.get(".".join(vllm_version.split(".")[:2]))


def plan_inputs() -> dict[str, list[str]]:
    """Which fields feed which part of the plan."""
    out: dict[str, list[str]] = {}
    for f in FIELDS:
        if f.plan_input:
            out.setdefault(f.plan_input, []).append(f.name)
    return out
