"""Kubernetes manifests from the plan (issue #28): validated offline against Kubernetes' schemas and the LWS API,
with the launch's exact flags bound to LeaderWorkerSet's variables; no cluster is claimed."""

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from servebook import k8s, params, topology, vllm_compat
from servebook.errors import ServebookError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
KIMI = REPO / "params" / "kimi-k2.5-k8s-2x8-h100.yaml"


def kimi(*overrides: str) -> k8s.Manifests:
    return topology.export_k8s(params.load(KIMI, list(overrides)), str(CONFIGS / "kimi-k2.5.json"))


def lws_of(m: k8s.Manifests) -> dict:
    return next(o for o in m.objects() if o["kind"] == "LeaderWorkerSet")


def container(m: k8s.Manifests, role: str) -> dict:
    return lws_of(m)["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]


def as_kubernetes_expands(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args, and its $$ escape."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env[m.group(1)], arg)


POD_ENV = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "10.0.0.9"}


def test_the_kimi_example_renders_valid_objects_with_the_plans_flags():
    m = kimi()
    assert k8s.validate(m) == []
    lws = lws_of(m)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["spec"]["replicas"] == 1
    assert lws["metadata"]["namespace"] == "llm"
    leader, worker = container(m, "leaderTemplate"), container(m, "workerTemplate")
    assert leader["image"] == "vllm/vllm-openai:v0.25.0"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the plan's own commands for this layout (what stage 03 would run over SSH), head first
    from servebook.stages.plan import launch_commands

    p = params.load(KIMI, [f"model={CONFIGS / 'kimi-k2.5.json'}"])
    head, node1 = launch_commands(p, m.device, m.parallelism)
    flags = leader["args"][1:]
    assert flags[flags.index("--data-parallel-address") + 1] == "$(LWS_LEADER_ADDRESS)"
    # every serving flag the same as the SSH launch's, but the address the cluster gives and the bind address
    assert _without(flags, "--data-parallel-address", "--host") == _without(
        head[head.index("--served-model-name") :], "--data-parallel-address", "--host"
    )
    # the worker's start rank is arithmetic Kubernetes does not do: the shell does it, from LWS_WORKER_INDEX
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    script = as_kubernetes_expands(worker["command"][2], POD_ENV).replace("exec vllm serve", "printf '%s\\n'", 1)
    pod = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True, env=POD_ENV)
    printed = pod.stdout.split()  # LWS puts its variables in the pod's environment, where the shell reads them
    assert _without(printed[1:], "--host", "--data-parallel-address") == _without(
        node1[node1.index("--served-model-name") :], "--host", "--data-parallel-address"
    )
    assert printed[printed.index("--data-parallel-start-rank") + 1] == "2"


def test_the_hybrid_shape_exports_an_api_server_in_every_pod_behind_one_service():
    """#38: each serving shape owns its manifests. Hybrid data parallelism: every pod runs its own ranks' API
    (--data-parallel-hybrid-lb, never --headless) with the leader's probes, and the Service selects every pod of
    the set, where the default shape's selects the leaders only."""
    m = kimi("data_parallel_lb=hybrid")
    assert k8s.validate(m) == []
    leader, worker = container(m, "leaderTemplate"), container(m, "workerTemplate")
    assert "--data-parallel-hybrid-lb" in leader["args"] and "--data-parallel-hybrid-lb" in worker["command"][2]
    assert "--headless" not in worker["command"][2]
    assert worker["readinessProbe"] == leader["readinessProbe"] and worker["ports"] == leader["ports"]
    script = as_kubernetes_expands(worker["command"][2], POD_ENV).replace("exec vllm serve", "printf '%s\\n'", 1)
    pod = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True, env=POD_ENV)
    printed = pod.stdout.split()
    assert printed[printed.index("--data-parallel-start-rank") + 1] == "2"  # worker 1 of 2 ranks per pod
    selector = next(o for o in m.objects() if o["kind"] == "Service")["spec"]["selector"]
    assert selector == {k8s.LWS_NAME_LABEL: m.name}
    assert any("every pod serves the API" in n for n in m.notes) and not any("--headless" in n for n in m.notes)
    assert "every pod serves the API" in m.files["README.md"]
    default = next(o for o in kimi().objects() if o["kind"] == "Service")["spec"]["selector"]
    assert default == {k8s.LWS_NAME_LABEL: m.name, "role": "leader"}
    assert "--headless" in container(kimi(), "workerTemplate")["command"][2]


def test_a_ray_server_is_exported_on_vllms_own_multinode_launch_and_says_so():
    """The Ray shape in a cluster: the same commands as the mp shape's (LWS wires the pods together; no Ray
    cluster is started in them), and the README says why."""
    ray, mp = kimi("distributed_backend=ray"), kimi()
    assert k8s.validate(ray) == []
    assert ray.files["lws.yaml"] == mp.files["lws.yaml"]
    assert any("distributed_backend: ray" in n and "(mp)" in n for n in ray.notes)
    assert "distributed_backend: ray" in ray.files["README.md"] and "distributed_backend" not in mp.files["README.md"]


def _without(args: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


def test_one_engine_across_the_pods_takes_its_node_flags_from_lws():
    m = kimi("layout_from_plan=false", "tensor_parallel_size=8", "pipeline_parallel_size=2")
    assert m.strategy == "mp" and k8s.validate(m) == []
    leader, worker = container(m, "leaderTemplate"), container(m, "workerTemplate")
    for c in (leader, worker):
        args = c["args"]
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        assert args[args.index("--master-port") + 1] == "29500"
    assert "--headless" in worker["args"] and "--headless" not in leader["args"]
    assert "ports" not in worker and "readinessProbe" not in worker  # a headless node serves no API


def test_vllms_own_parser_takes_the_pods_commands():
    m = kimi("layout_from_plan=false", "tensor_parallel_size=8", "pipeline_parallel_size=2")
    for role in ("leaderTemplate", "workerTemplate"):
        args = [as_kubernetes_expands(a, POD_ENV) for a in container(m, role)["args"]]
        parsed = vllm_compat.parse_serve_args(args[0], args[1:])
        assert parsed.ok, (role, parsed.message)


def test_probes_env_and_volumes_come_from_the_plan():
    m = kimi()
    leader = container(m, "leaderTemplate")
    startup = leader["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 4200 == m.startup_budget_s  # load_timeout_s
    assert leader["readinessProbe"]["exec"]["command"][:2] == ["python3", "-c"]
    assert "/v1/models" in leader["readinessProbe"]["exec"]["command"][2]
    env = {e["name"]: e for e in leader["env"]}
    assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kimi-k2-5-k8s-api-key", "key": "VLLM_API_KEY"}
    assert env["NCCL_IB_HCA"]["value"] == "mlx5"
    pod = lws_of(m)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "kimi-k2-5-weights"
    assert leader["args"][0] == "/models/moonshotai/Kimi-K2.5"  # the download stage's folder in the claim
    assert "--host" in leader["args"] and leader["args"][leader["args"].index("--host") + 1] == "0.0.0.0"


def test_the_key_stays_out_of_every_file(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-must-not-appear-31337")
    m = kimi()
    assert all("sk-must-not-appear-31337" not in text for text in m.files.values())
    assert 'create secret generic kimi-k2-5-k8s-api-key --from-literal=VLLM_API_KEY="$VLLM_API_KEY"' in m.files[
        "README.md"]  # fmt: skip


def test_two_replicas_get_vllm_router_with_discovery_and_rights_to_find_the_leaders():
    m = topology.export_k8s(params.load(REPO / "params" / "minimax-m2.5-2-replicas.yaml", ["plan_gpu=H200"]),
                   str(CONFIGS / "minimax-m2.5.json"))  # fmt: skip
    assert k8s.validate(m) == []
    kinds = sorted(o["kind"] for o in m.objects())
    assert kinds == ["Deployment", "LeaderWorkerSet", "Role", "RoleBinding", "Service", "Service", "ServiceAccount"]
    assert lws_of(m)["spec"]["replicas"] == 2
    deployment = next(o for o in m.objects() if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "cache_aware"
    selector = args[args.index("--selector") + 1 : args.index("--service-discovery-port")]
    leader_labels = lws_of(m)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    assert "role=leader" in selector and all(s.split("=")[1] == leader_labels.get(s.split("=")[0], s.split("=")[1])
                                             for s in selector)  # fmt: skip
    front = next(o for o in m.objects() if o["kind"] == "Service" and o["metadata"]["name"] == m.name)
    assert front["spec"]["selector"] == {"app.kubernetes.io/name": f"{m.name}-router"}
    assert "FROM python" in m.files["router.Dockerfile"] and "vllm-router==" in m.files["router.Dockerfile"]


@pytest.mark.parametrize(
    "break_it, says",
    [
        (lambda lws: lws["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"), "restartPolicy"),
        (lambda lws: lws["spec"].update(replica=2), "Additional properties are not allowed ('replica'"),
        (
            lambda lws: lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0].update(
                ports=[{"name": "http", "containerPort": "8000"}]
            ),
            "leaderTemplate",
        ),
        (
            lambda lws: lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(
                imagePullPolicy=3
            ),
            "workerTemplate",
        ),
    ],
    ids=["restart policy", "misspelt field", "port as text", "worker field type"],
)
def test_a_broken_manifest_is_caught_where_it_breaks(break_it, says):
    m = kimi()
    broken = copy.deepcopy(lws_of(m))
    break_it(broken)
    m.files["lws.yaml"] = yaml.safe_dump(broken)
    problems = k8s.validate(m)
    assert problems and any(says in p for p in problems), problems


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_folder(tmp_path):
    m = kimi()
    m.write(tmp_path)
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    assert sorted(o["kind"] for o in objects) == ["LeaderWorkerSet", "Service"]
    assert all(o["metadata"]["namespace"] == "llm" for o in objects)


def test_what_cannot_be_exported_is_refused_by_name(tmp_path):
    with pytest.raises(ServebookError, match="set plan_gpu"):
        topology.export_k8s(params.load(KIMI, ["plan_gpu="]), str(CONFIGS / "kimi-k2.5.json"))
    with pytest.raises(ServebookError, match="built on the machine that runs servebook"):
        topology.export_k8s(params.load(REPO / "params" / "ci.yaml", ["plan_gpu=H100"]))


def test_the_cli_writes_a_new_folder_and_never_overwrites_one(tmp_path):
    out = tmp_path / "k8s"
    cmd = [str(Path(shutil.which("servebook") or REPO / ".venv" / "bin" / "servebook")), "export", "k8s", str(KIMI),
           "--model-config", str(CONFIGS / "kimi-k2.5.json"), "--out", str(out)]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "valid: 2 objects" in first.stdout and (out / "lws.yaml").is_file()
    before = (out / "lws.yaml").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert (out / "lws.yaml").read_text() == before


def test_the_committed_kimi_manifests_are_what_the_example_renders_today():
    """docs/examples/k8s-kimi-k2.5/ is the closing note's rendered example: it must not drift from the code."""
    committed = REPO / "docs" / "examples" / "k8s-kimi-k2.5"
    m = kimi()
    assert sorted(p.name for p in committed.iterdir()) == sorted(m.files)
    for name, text in m.files.items():
        assert (committed / name).read_text() == text, f"{name} differs: re-render with servebook export k8s"
