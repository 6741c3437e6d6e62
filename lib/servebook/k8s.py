"""Kubernetes manifests from the plan: a LeaderWorkerSet whose pods run exactly the launch's ``vllm serve``.

One LWS group is one replica of the server: ``size`` pods, one per node, the leader serving the API. The node flags
are the ones servebook's own multi-node launch uses (:func:`servebook.multinode.node_flags`), with the values that
only the cluster knows bound to what LWS injects into every pod (as vLLM production-stack's ``lws-vllm.yaml``
does): ``$(LWS_GROUP_SIZE)`` for ``--nnodes``, ``$(LWS_WORKER_INDEX)`` for ``--node-rank``,
``$(LWS_LEADER_ADDRESS)`` for the master or data-parallel address.  A data-parallel layout's workers need a start
rank of ``LWS_WORKER_INDEX x ranks per node``; Kubernetes does no arithmetic, so those pods run the command through
``/bin/sh -c`` (as llm-d's wide-EP manifests do), everything else is plain ``args``.

What the plan decides is in the manifests: the GPUs per pod, a shared-memory volume sized to the node's ranks, a
startup probe that allows the load budget (a 547 GB checkpoint loads for many minutes: the default probe would
restart the pod long before), readiness on ``/v1/models`` plus a one-token completion (``/health`` answers while
an engine that cannot serve hangs), the API key from a Secret.  Several replicas (``replicas``) are that many LWS
groups behind vllm-router, which finds the leaders by label (its Kubernetes service discovery).

Validation is offline (no cluster is needed and none is claimed): the core objects against Kubernetes' own schemas
(``kubernetes-validate``), the LWS against the LWS API's schema in ``k8s_schemas/`` with its pod templates checked
as core ``PodTemplateSpec``.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from servebook import download, gpus, models, multinode, planner, router, startplan
from servebook.errors import ServebookError
from servebook.json_types import JsonObject
from servebook.params import Params
from servebook.server_config import SERVER_KEY_VAR, ServerConfig, load_budget_s

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set by the LWS controller on every pod of the set
GROUP_SIZE, WORKER_INDEX, LEADER_ADDRESS = "$(LWS_GROUP_SIZE)", "$(LWS_WORKER_INDEX)", "$(LWS_LEADER_ADDRESS)"
MODEL_MOUNT = "/models"  # where the checkpoint volume sits in a pod when model_store is a home-relative path
PROBE_PERIOD_S = 10
KUBERNETES_VERSION = "1.32"  # the schemas the core objects are checked against (kubectl 1.32 ships in this image)
ROUTER_PORT = 8000


@dataclass
class Manifests:
    """The rendered files (name to YAML text) and what the plan put into them."""

    name: str
    namespace: str
    files: dict[str, str]
    layout: str
    strategy: str  # "mp" (one engine spanning the group's pods), "dp" (a data-parallel engine per pod), "" one pod
    group_size: int
    replicas: int
    startup_budget_s: int
    parallelism: planner.Parallelism
    device: planner.Device
    notes: list[str] = field(default_factory=list)

    def objects(self) -> list[JsonObject]:
        return [doc for name, text in self.files.items() if name.endswith(".yaml") and name != "kustomization.yaml"
                for doc in yaml.safe_load_all(text) if doc]  # fmt: skip

    def write(self, folder: Path) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in self.files.items():
            path = folder / name
            path.write_text(text)
            written.append(path)
        return written


def shm_gib(ranks_per_pod: int) -> int:
    """The pod's /dev/shm: NCCL's shared-memory transport and vLLM's multiprocessing queues between the ranks on one
    node; a container runtime's 64 MiB default fails NCCL's first collective."""
    return max(8, 2 * ranks_per_pod)


def model_in_pod(p: Params) -> tuple[str, str]:
    """(the checkpoint as vLLM in the pod names it, the volume's mount path): the download stage's folder under
    ``model_store``; a home-relative store (``~/...``) has no meaning in a pod and mounts at /models instead."""
    store = p.model_store if not p.model_store.startswith("~") else MODEL_MOUNT
    if models.is_builtin(p.model):
        raise ServebookError(
            f"model {p.model} is built on the machine that runs servebook; a cluster serves a checkpoint: set model "
            "to a hub repo id or a folder under model_store"
        )
    if p.model.startswith(("/", "./", "../", "~")):
        return str(Path(p.model).expanduser()), str(Path(p.model).expanduser().parent)
    return str(download.local_dir_for(store, p.model)), store


def serve_command(cfg: ServerConfig, model: str, node: list[str]) -> list[str]:
    """``vllm serve`` as the image runs it: the launch's serving flags, bound to every address in the pod (its own
    network namespace: the Service, not the host, is the door; the key guards it) and the node's part."""
    args = cfg.serve_args()
    args[args.index("--host") + 1] = "0.0.0.0"
    node_at = len(args) - len(cfg.extra_args)
    return ["vllm", "serve", model, *args[:node_at], *node, *args[node_at:]]


def node_parts(
    layout: planner.Parallelism, nodes: int, per_node: int, port: int, *, hybrid: bool = False
) -> tuple[list[str], list[str]]:
    """The leader's and a worker's node flags, with LWS's variables where the cluster decides the value;
    ``hybrid``: every pod serves its own data-parallel ranks' API (vLLM's --data-parallel-hybrid-lb)."""
    if nodes <= 1:
        return [], []
    try:
        leader, worker = (
            multinode.node_flags(layout, nodes, per_node, rank, head_address=LEADER_ADDRESS, port=port, hybrid=hybrid)
            for rank in (0, 1)
        )
    except ValueError as exc:
        raise ServebookError(str(exc)) from exc
    if layout.strategy(per_node) == "dp":
        local = per_node // (layout.tp * layout.pp)
        at = worker.index("--data-parallel-start-rank") + 1
        worker[at] = f"$$((LWS_WORKER_INDEX * {local}))"  # "$$" is Kubernetes' escape: the shell gets "$((...))"
        return leader, worker
    for flags in (leader, worker):
        flags[flags.index("--nnodes") + 1] = GROUP_SIZE
        flags[flags.index("--node-rank") + 1] = WORKER_INDEX
    return leader, worker


def readiness_script(port: int, served_model_name: str) -> str:
    """What the readiness probe runs in the leader: /v1/models lists the model and one token comes back, with the
    key vLLM itself was given (its VLLM_API_KEY). Exit status 0 is ready."""
    return (
        "import json, os, urllib.request as u\n"
        f"base = 'http://127.0.0.1:{port}'\n"
        f"key = os.environ.get('{SERVER_KEY_VAR}', '')\n"
        "h = {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'} if key else "
        "{'Content-Type': 'application/json'}\n"
        "listed = json.load(u.urlopen(u.Request(base + '/v1/models', headers=h), timeout=5))\n"
        f"assert any(m['id'] == {served_model_name!r} for m in listed['data']), listed\n"
        f"body = json.dumps({{'model': {served_model_name!r}, 'prompt': 'ping', 'max_tokens': 1}}).encode()\n"
        "answer = json.load(u.urlopen(u.Request(base + '/v1/completions', data=body, headers=h), timeout=20))\n"
        "assert answer['choices'][0]['text'] is not None\n"
    )


def _env(p: Params, cfg: ServerConfig, budget_s: int) -> list[JsonObject]:
    env: list[JsonObject] = [
        # vLLM's own address for this node, the pod's IP (what the other pods reach; a wrong one is the classic
        # multi-node hang)
        {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": str(budget_s)},
    ]
    if p.api_key_env:
        env.append(
            {"name": SERVER_KEY_VAR, "valueFrom": {"secretKeyRef": {"name": secret_name(p), "key": SERVER_KEY_VAR}}}
        )
    env += [{"name": k, "value": v} for k, v in sorted(cfg.extra_env.items())]
    return env


def secret_name(p: Params) -> str:
    return f"{_name(p)}-api-key"


def _name(p: Params) -> str:
    base = (p.run_name or p.served_model_name or models.default_served_name(p.model)).lower()
    cleaned = "".join(c if c.isalnum() else "-" for c in base).strip("-")
    return ("-".join(part for part in cleaned.split("-") if part) or "servebook")[:40]


def _container(
    p: Params,
    command: list[str],
    per_pod_gpus: int,
    env: list[JsonObject],
    mount: str,
    *,
    leader: bool,
    shell: bool,
) -> JsonObject:
    c: JsonObject = {"name": "vllm-leader" if leader else "vllm-worker", "image": p.k8s_image}
    if shell:
        c["command"] = ["/bin/sh", "-c", "exec " + " ".join(_sh(a) for a in command)]
    else:
        c["command"], c["args"] = command[:2], command[2:]
    c["env"] = env
    c["resources"] = {"limits": {"nvidia.com/gpu": per_pod_gpus}, "requests": {"nvidia.com/gpu": per_pod_gpus}}
    c["volumeMounts"] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "models", "mountPath": mount, "readOnly": True},
    ]
    return c


def _sh(arg: str) -> str:
    """Quote for the shell, leaving Kubernetes' $(VAR) and the shell's $$((...)) for them to expand."""
    return arg if arg.startswith(("$(", "$$((")) else shlex.quote(arg)


def _leader_probes(port: int, served_name: str, budget: int) -> JsonObject:
    """The leader's port and probes: started within the load budget, ready while a token comes back, alive while
    ``/health`` answers."""
    return {
        "ports": [{"name": "http", "containerPort": port}],
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": math.ceil(budget / PROBE_PERIOD_S),
        },
        "readinessProbe": {
            "exec": {"command": ["python3", "-c", readiness_script(port, served_name)]},
            "periodSeconds": 30,
            "timeoutSeconds": 25,
            "failureThreshold": 2,
        },
        "livenessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 30, "failureThreshold": 4},
    }


def _volumes(model_pvc: str, mount: str, ranks_per_pod: int) -> list[JsonObject]:
    """The pod's shared memory, and the checkpoint: a claim where one is named, else the same host path."""
    return [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(ranks_per_pod)}Gi"}},
        {"name": "models", **(
            {"persistentVolumeClaim": {"claimName": model_pvc, "readOnly": True}} if model_pvc
            else {"hostPath": {"path": mount, "type": "Directory"}}
        )},
    ]  # fmt: skip


def render(
    p: Params, plan: planner.Plan, layout: planner.Layout, *, hybrid: bool = False, shape_notes: tuple[str, ...] = ()
) -> Manifests:
    """The manifests for ``layout`` (accepted by the plan) on ``p.nodes`` nodes of ``plan.device.per_node`` GPUs;
    ``hybrid``: every pod serves the API for its own data-parallel ranks and the Service spreads requests over all
    of them (the serving shape decides: :meth:`servebook.topology.Topology.manifests`); ``shape_notes`` go to the
    README."""
    if not layout.accepted:
        raise ServebookError(f"layout {layout.name} is not one vLLM accepts here: {layout.reasons[0]}")
    nodes, per_node = plan.device.nodes, plan.device.per_node
    par = layout.parallelism
    model, mount = model_in_pod(p)
    cfg = ServerConfig.from_params(p, "cuda", par, model_path=model)
    name, ns = _name(p), p.k8s_namespace
    size_bytes = p.checkpoint_gb * 1e9 if p.checkpoint_gb else models.checkpoint_bytes(cfg.model_path)[0]
    budget = int(load_budget_s(size_bytes, p.load_timeout_s))
    ranks_per_pod = par.world_size // nodes
    leader_flags, worker_flags = node_parts(par, nodes, per_node, p.node_master_port, hybrid=hybrid)
    strategy = par.strategy(per_node) if nodes > 1 else ""
    env = _env(p, cfg, budget)
    leader_cmd = serve_command(cfg, model, leader_flags)
    leader = _container(p, leader_cmd, ranks_per_pod, env, mount, leader=True, shell=False)
    leader |= _leader_probes(p.port, cfg.served_model_name, budget)
    volumes = _volumes(p.k8s_model_pvc, mount, ranks_per_pod)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "servebook"}
    template: JsonObject = {
        "size": nodes,
        "restartPolicy": "RecreateGroupOnPodRestart",  # a lost node breaks the engine: the group starts again
        "leaderTemplate": {"metadata": {"labels": {**labels, "role": "leader"}},
                           "spec": {"containers": [leader], "volumes": volumes}},
    }  # fmt: skip
    if nodes > 1:
        worker = _container(p, serve_command(cfg, model, worker_flags), ranks_per_pod, env, mount, leader=False,
                            shell=strategy == "dp")  # fmt: skip
        if hybrid:  # its own API server: ready and alive the way the leader is
            worker |= _leader_probes(p.port, cfg.served_model_name, budget)
        template["workerTemplate"] = {"metadata": {"labels": {**labels, "role": "worker"}},
                                      "spec": {"containers": [worker], "volumes": volumes}}  # fmt: skip
    else:
        template["workerTemplate"] = template["leaderTemplate"]  # LWS requires it; with size 1 only the leader runs
    lws = {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "replicas": p.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": template,
        },
    }  # fmt: skip
    leader_selector = {LWS_NAME_LABEL: name, "role": "leader"}
    serving_pods = {LWS_NAME_LABEL: name} if hybrid else leader_selector
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name if p.replicas == 1 else f"{name}-leaders", "namespace": ns, "labels": labels},
        "spec": {"selector": serving_pods, "ports": [{"name": "http", "port": p.port, "targetPort": p.port}]},
    }
    files = {"lws.yaml": _dump([lws]), "service.yaml": _dump([service])}
    notes = [
        f"{p.replicas} group(s) of {nodes} pod(s), {ranks_per_pod} GPU(s) each: {par.name}"
        + (f", {multinode_strategy(strategy)}" if strategy and not hybrid else ""),
        f"startup probe allows {budget} s ({math.ceil(budget / PROBE_PERIOD_S)} x {PROBE_PERIOD_S} s), the load budget",
        *shape_notes,
    ]
    if p.replicas > 1:
        files["router.yaml"] = _dump(_router_objects(p, name, ns, labels, leader_selector))
        files["router.Dockerfile"] = router_dockerfile()
        notes.append(f"vllm-router ({p.router_policy}) in front of the {p.replicas} leaders, found by label")
    files["kustomization.yaml"] = _dump([{
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": ns,
        "resources": [f for f in files if f.endswith(".yaml")],
    }])  # fmt: skip
    files["README.md"] = _readme(p, name, ns, notes)
    return Manifests(name, ns, files, par.name, strategy, nodes, p.replicas, budget, par, plan.device, notes)


def cluster_plan(p: Params, model_config: str = "") -> tuple[planner.Plan, planner.Layout]:
    """`servebook export k8s`'s plan: for the cluster's GPUs (``plan_gpu`` x ``gpus_per_node`` on ``nodes``) as
    the plan stage does, and the layout stage 03 would launch (the shape renders it:
    :func:`servebook.topology.export_k8s`).

    ``model_config`` is a config.json to plan from where the Hub cannot be reached; the pods still serve ``model``."""
    if not p.plan_gpu:
        raise ServebookError(
            "export k8s plans for the cluster's GPUs, not this machine's: set plan_gpu (e.g. plan_gpu: H100) and "
            "gpus_per_node"
        )
    count = p.plan_gpu_count or p.nodes * p.per_node
    link = planner.parse_interconnect(p.node_interconnect) if p.nodes > 1 else None
    device = planner.Device.for_gpu(gpus.lookup(p.plan_gpu), count, nodes=p.nodes, link=link)
    planned = startplan.plan(p, device, model_config)
    chosen = startplan.chosen_layout(p, planned)
    if chosen is None or not chosen.accepted:
        why = chosen.reasons[0] if chosen and chosen.reasons else "no layout fits"
        raise ServebookError(
            f"the plan accepts no layout to export for {p.model} on {p.nodes} x {p.per_node} {p.plan_gpu}: {why}; "
            "change the layout, or set layout_from_plan: true"
        )
    return planned, chosen


def multinode_strategy(strategy: str) -> str:
    return planner.MULTINODE_STRATEGIES.get(strategy, strategy)


def _router_objects(p: Params, name: str, ns: str, labels: dict[str, str], leaders: dict[str, str]) -> list[JsonObject]:
    """vllm-router with Kubernetes discovery of the leaders: its account may list and watch pods in the namespace."""
    rname = f"{name}-router"
    rlabels = {**labels, "app.kubernetes.io/component": "router"}
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--policy", p.router_policy, "--service-discovery",
            "--selector", *[f"{k}={v}" for k, v in leaders.items()], "--service-discovery-port", str(p.port),
            "--service-discovery-namespace", ns, "--health-check-endpoint", "/health"]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": rname, "namespace": ns, "labels": rlabels}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": rname, "namespace": ns, "labels": rlabels},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": rname, "namespace": ns, "labels": rlabels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
         "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": ns}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": rname, "namespace": ns, "labels": rlabels},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": rname}},
                  "template": {"metadata": {"labels": {**rlabels, "app.kubernetes.io/name": rname}},
                               "spec": {"serviceAccountName": rname, "containers": [{
                                   "name": "vllm-router", "image": p.k8s_router_image, "command": ["vllm-router"],
                                   "args": args, "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
                                   "readinessProbe": {"httpGet": {"path": "/health", "port": ROUTER_PORT},
                                                      "periodSeconds": 10},
                               }]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns, "labels": rlabels},
         "spec": {"selector": {"app.kubernetes.io/name": rname},
                  "ports": [{"name": "http", "port": p.port, "targetPort": ROUTER_PORT}]}},
    ]  # fmt: skip


def router_dockerfile() -> str:
    version = router.installed_version() or "0.1.17"
    return (
        "# vllm-router ships as a PyPI wheel (a Rust binary), not an image: build one and set k8s_router_image to it\n"
        "FROM python:3.11-slim\n"
        f"RUN pip install --no-cache-dir vllm-router=={version}\n"
        'ENTRYPOINT ["vllm-router"]\n'
    )


def _readme(p: Params, name: str, ns: str, notes: list[str]) -> str:
    lines = [f"# {name}: Kubernetes manifests rendered by servebook from the plan", "", *[f"- {n}" for n in notes], ""]
    lines += ["Needs the LeaderWorkerSet controller (kubernetes-sigs/lws) and the NVIDIA device plugin.", ""]
    if p.api_key_env:
        lines += [
            "The API key goes into a Secret from your shell, never into these files:",
            "",
            f"    kubectl -n {ns} create secret generic {secret_name(p)} "
            f'--from-literal={SERVER_KEY_VAR}="${p.api_key_env}"',
            "",
        ]
    store = "the PersistentVolumeClaim " + p.k8s_model_pvc if p.k8s_model_pvc else "the same host path on every node"
    lines += [f"The checkpoint is read from {store} (the download stage's folder).", "", "    kubectl apply -k .", ""]
    return "\n".join(lines)


class _Dumper(yaml.SafeDumper):
    """Plain YAML a person reads: no anchors for the env and volumes two templates share, scripts as blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _block_strings(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _block_strings)


def _dump(objects: list[JsonObject]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120)


# validation -------------------------------------------------------------------------------------------------------


def lws_schema() -> JsonObject:
    text = resources.files("servebook").joinpath("k8s_schemas/leaderworkerset-v1.json").read_text()
    schema: JsonObject = json.loads(text)
    return schema


def validate(m: Manifests, version: str = KUBERNETES_VERSION) -> list[str]:
    """Every object checked offline: core and apps objects against Kubernetes' schemas for ``version``, the LWS
    against the LWS API's schema and its two pod templates as core ``PodTemplateSpec``. Returns the problems."""
    try:
        import jsonschema
        import kubernetes_validate
    except ImportError as exc:
        raise ServebookError(
            f"validating manifests needs {exc.name}: pip install 'servebook[k8s]' (kubernetes-validate)"
        ) from exc
    problems: list[str] = []

    def core(obj: JsonObject, what: str) -> None:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(x) for x in exc.path)
            problems.append(f"{what}: {path}: {exc.message}")

    for obj in m.objects():
        what = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["apiVersion"] != LWS_API:
            core(obj, what)
            continue
        for err in jsonschema.Draft7Validator(lws_schema()).iter_errors(obj):
            problems.append(f"{what}: {'.'.join(str(x) for x in err.absolute_path)}: {err.message}")
        for role in ("leaderTemplate", "workerTemplate"):
            pod = obj["spec"]["leaderWorkerTemplate"].get(role)
            if pod is not None:
                wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{obj['metadata']['name']}"},
                           "template": pod}  # fmt: skip
                core(wrapper, f"{what} {role}")
    return problems
