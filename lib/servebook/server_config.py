"""One server's configuration: what the params set, as the flags, environment and key a vLLM launch gets.

The one owner of the serving command (the plan prints it, the launch runs it, deploy writes it into a unit),
of the server's environment, of the API key's path (the server gets it as ``VLLM_API_KEY``, every client sends
it as a bearer token, a unit's environment file carries it) and of the load budget.  It imports no process or
HTTP machinery, so records, the plan and the A/B can build one without psutil.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from servebook import hardware, models, secrets, serving, startup, vllm_compat
from servebook.client import Target, bearer
from servebook.errors import PreflightError
from servebook.params import Params
from servebook.planner import Parallelism

SECONDS_PER_GB = 6.0  # load-budget slope: 547 GB took 36 minutes in the story
BASE_BUDGET_S = 300.0  # imports, torch.compile warm-up and graph capture on a small model
SERVER_KEY_VAR = "VLLM_API_KEY"  # the variable vLLM reads its --api-key from


def load_budget_s(checkpoint_bytes: float | None, load_timeout_s: float = 0.0) -> float:
    """How long a load may take before it counts as failed: ``load_timeout_s``, or grown with the checkpoint."""
    if load_timeout_s:
        return float(load_timeout_s)
    return BASE_BUDGET_S + SECONDS_PER_GB * (checkpoint_bytes or 0) / 1e9


def _default(name: str) -> Any:
    """A serving field's default is the vocabulary's: one owner, :class:`~servebook.params.Params`."""
    value = Params.model_fields[name].get_default(call_default_factory=True)
    if isinstance(value, (list, dict)):
        return field(default_factory=lambda: type(value)(value))
    return field(default=value)


@dataclass
class ServerConfig:
    """Everything that determines a server's behaviour; its hash decides reuse.

    Every field but :data:`DERIVED` is the :class:`Params` field of the same name, read by
    :meth:`from_params`; a field Params lacks fails there, loudly, instead of taking a default."""

    model: str  # what the params named
    model_path: str  # what vLLM loads
    served_model_name: str
    host: str = _default("host")
    port: int = _default("port")
    device: str = "cpu"
    layout: Parallelism = field(default_factory=Parallelism)  # the params' four layout fields, or the plan's choice
    gpu_ids: list[int] = _default("gpu_ids")
    max_model_len: int = _default("max_model_len")
    gpu_memory_utilization: float = _default("gpu_memory_utilization")
    kv_cache_dtype: str = _default("kv_cache_dtype")
    cpu_kv_cache_gib: float = _default("cpu_kv_cache_gib")
    enforce_eager: bool = _default("enforce_eager")
    max_num_seqs: int = _default("max_num_seqs")
    api_key_env: str = _default("api_key_env")
    extra_args: list[str] = _default("extra_args")
    extra_env: dict[str, str] = _default("extra_env")
    load_timeout_s: float = _default("load_timeout_s")
    max_num_batched_tokens: int = _default("max_num_batched_tokens")
    load_strategy: str = _default("load_strategy")  # "auto" is resolved by the launch stage from the plan
    load_format: str = _default("load_format")
    ep_weight_filter: str = _default("ep_weight_filter")
    distributed_backend: str = _default("distributed_backend")
    data_parallel_lb: str = _default("data_parallel_lb")
    node_flags: list[str] = field(default_factory=list)  # the head's part of a multi-node server (multinode.py)
    nodes: int = 1  # machines the server spans; this one holds world_size / nodes of its GPUs

    @classmethod
    def from_params(
        cls, params: Params, device: str, layout: Parallelism | None = None, model_path: str | None = None
    ) -> ServerConfig:
        """Build from parameters; a plan's recommended layout overrides the layout keys, a download's folder the model."""
        chosen = {name: getattr(params, name) for name in serving_fields()}
        chosen["served_model_name"] = chosen["served_model_name"] or models.default_served_name(chosen["model"])
        return cls(
            model_path=model_path or models.resolve(params.model), device=device, layout=layout or params.layout,
            **chosen,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def target_gpus(self) -> list[int]:
        return hardware.target_gpus(self.gpu_ids, self.world_size // self.nodes) if self.device == "cuda" else []

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def serve_args(self) -> list[str]:
        """vLLM flags after the model, in the order a person would write them (``serving.FIELDS``), then this
        node's part of a multi-node server and ``extra_args``."""
        return serving.command_args(self) + list(self.node_flags) + list(self.extra_args)

    def conflicts(self) -> list[str]:
        return serving.conflicts(self.extra_args)

    def dry(self) -> ServerConfig:
        """The same server with random weights (``--load-format dummy``): every flag, the real shapes, KV sizing and
        graph capture, without reading the checkpoint."""
        return dataclasses.replace(self, load_format="dummy", load_strategy="default")

    def command(self) -> list[str]:
        return vllm_compat.serve_prefix(self.model_path) + self.serve_args()

    def load_budget_s(self) -> float:
        size, _ = models.checkpoint_bytes(self.model_path)
        return load_budget_s(size, self.load_timeout_s)

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
        else:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device N is NVML's index N
            if self.gpu_ids:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        if base is None:  # a server started here keeps its compile cache between launches (a unit has its own)
            env.setdefault("VLLM_CACHE_ROOT", str(startup.vllm_cache_root()))
        env.pop(SERVER_KEY_VAR, None)
        if with_secrets:
            env.update(self.secret_env())
        env.update(self.extra_env)
        return env

    def api_key(self) -> str | None:
        """The key the server requires, from the variable ``api_key_env`` names; None without one.

        Raises :class:`PreflightError` when ``api_key_env`` names a variable that is not set: a server started
        keyless, or a client sending no key, would each fail later and less clearly."""
        if not self.api_key_env:
            return None
        secrets.declare(self.api_key_env)  # masked wherever servebook writes, whatever the variable is called
        if self.api_key_env not in os.environ:
            raise PreflightError(
                f"api_key_env names {self.api_key_env}, which is not set; export it or set api_key_env: ''"
            )
        return os.environ[self.api_key_env]

    def secret_env(self) -> dict[str, str]:
        """What a server process (or a unit's environment file) must carry for its key: ``VLLM_API_KEY``."""
        key = self.api_key()
        return {SERVER_KEY_VAR: key} if key is not None else {}

    def client_headers(self) -> dict[str, str]:
        """What every request to this server carries."""
        return bearer(self.api_key())

    def target(self, timeout_s: float = 600.0) -> Target:
        """Where a client sends requests to this server, with its key."""
        return Target(self.url, self.served_model_name, self.client_headers(), timeout_s)

    def fingerprint(self) -> str:
        data = asdict(self)
        data.pop("load_timeout_s")
        data |= data.pop("layout").params()  # the layout's fields as the params name them
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# set by from_params's caller (the device, the download's folder, the plan's layout) or by multinode.prepare (a
# node's flags)
DERIVED = frozenset({"model_path", "device", "layout", "node_flags"})


def serving_fields() -> list[str]:
    """The :class:`Params` fields a server's configuration takes one by one (the layout's four come as one)."""
    return [f.name for f in dataclasses.fields(ServerConfig) if f.name not in DERIVED]
