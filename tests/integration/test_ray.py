"""A Ray cluster of two nodes, each in a network namespace of its own with one routable address and an OpenSSH
server (netns.py), started, joined, watched and stopped the way ``distributed_backend: ray`` does it. vLLM's CPU
build refuses Ray ("current platform cpu does not support ray"), so vLLM's side of that launch is checked against
vLLM's own parser (tests/unit/test_ray.py); here the embedded model is served by real vLLM beside a real cluster to
show the cluster is registered, reported and stopped with the server."""

import shlex
import signal
import subprocess
import sys

import pytest

from servebook import models, multinode, params, raycluster, remote, server
from servebook.errors import Interrupted, LaunchError, PreflightError
from servebook.topology import ray_nodes

from . import netns
from .conftest import config, ours_left

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not netns.available(), reason="needs root, iproute2 and Debian's openssh-server"),
]

PORT = 8171
START_ARGS = ["--num-cpus=1", "--object-store-memory=100000000"]  # two Ray nodes on a 2-core, 23 GB machine


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    found = netns.create(tmp_path_factory.mktemp("netns"))
    yield found
    found.close()


def cluster_of(ns: netns.Namespaces, **kw) -> raycluster.RayCluster:
    nodes = [raycluster.RayNode(f"node{i}", f"ray-{i}", a, sys.executable) for i, a in enumerate(ns.addresses)]
    values = dict(nodes=nodes, port=6390, start_args=START_ARGS, ssh_config=str(ns.ssh_config), join_timeout_s=120)
    values.update(kw)
    return raycluster.RayCluster(**values)


def ray_processes() -> list[str]:
    """Ray's own daemons anywhere on this host (the namespaces share its process table)."""
    out = subprocess.run(["ps", "-eo", "pid=,comm="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.split()[-1] in ("raylet", "gcs_server")]


def test_a_node_that_cannot_join_fails_the_launch_by_name_and_nothing_is_left(namespaces, tmp_path):
    cfg = config(PORT)
    cluster = cluster_of(namespaces, join_timeout_s=20)
    # node1 asks for the head on a port nothing listens on: its `ray start --address` gives up
    broken = cluster.start_command(cluster.nodes[1])
    broken[broken.index("--address") + 1] = f"{namespaces.addresses[0]}:6391"
    cluster.start_command = lambda node: broken if node is cluster.nodes[1] else type(cluster).start_command(
        cluster, node
    )  # fmt: skip
    with pytest.raises(LaunchError) as caught:
        ray_nodes.launch_on(cluster, cfg, tmp_path, log=print)
    message = str(caught.value)
    assert "node1" in message and ("exited before it joined" in message or "did not join" in message), message
    assert server.registered(PORT) is None  # no vLLM was started: the cluster comes first
    assert ray_processes() == []


def test_a_server_beside_the_cluster_is_registered_with_its_nodes_and_stopped_with_them(namespaces, tmp_path):
    """The Ray shape's one end-to-end test: two nodes join under their own addresses, a deployed head's
    ``ray-wait`` counts them, the embedded model is served beside the cluster, and one stop ends all of it."""
    cfg = config(PORT)
    cluster = cluster_of(namespaces)
    launched = ray_nodes.launch_on(cluster, cfg, tmp_path, log=print)
    try:
        # each node registered its own veth address: neither the host's nor a loopback one
        assert sorted(cluster.alive()) == namespaces.addresses
        registered = server.registered(PORT)
        assert registered is not None
        assert [w.address for w in registered.workers] == namespaces.addresses
        assert [w.node for w in registered.workers] == ["node0", "node1"]
        assert all(w.role == "ray" for w in registered.workers)
        (row,) = [s for s in server.status() if s.port == PORT]
        assert "2 nodes, every worker running" in row.detail, row.detail
        # what a deployed head's unit runs before its vLLM, on the head
        wait = [sys.executable, "-m", "servebook.cli", "ray-wait", "--address", cluster.address, "--nodes"]
        done = remote.run("ray-0", shlex.join([*wait, "2", "--timeout", "60"]), str(namespaces.ssh_config), 120)
        assert done.returncode == 0 and "counts 2 nodes alive" in done.stdout, done.stderr[-500:]
        done = remote.run("ray-0", shlex.join([*wait, "3", "--timeout", "5"]), str(namespaces.ssh_config), 120)
        assert done.returncode == 1 and "counts 2 of 3 nodes alive" in done.stderr, done.stderr[-500:]
        # the check that follows the stop sees a running node's Ray (it could fail)
        running = remote.leftovers(registered.workers[0])
        assert any("raylet" in item for item in running) and any("gcs_server" in item for item in running), running
    finally:
        outcome = server.stop(port=PORT)
    assert outcome.remaining == []
    assert ours_left(launched.pgid) == []
    assert cluster.alive() == []
    assert ray_processes() == []
    assert server.registered(PORT) is None
    assert all(not remote.alive(w) for w in registered.workers)


def test_a_node_without_the_heads_ray_is_refused_before_anything_starts(namespaces):
    """node1's Python (the system's, no Ray, no vLLM) probed over SSH in its namespace: the preflight names it and
    the fix; nothing is started on either node."""
    p = params.Params(
        model="builtin:tiny-qwen3-moe", device="cuda", tensor_parallel_size=2, nodes=2, gpus_per_node=1,
        node_hosts=["local", "ray-1"], node_addresses=[namespaces.gateway, namespaces.addresses[1]],
        node_ssh_config=str(namespaces.ssh_config), node_python="/usr/bin/python3", distributed_backend="ray",
    )  # fmt: skip
    with pytest.raises(PreflightError) as refused:
        multinode.preflight(
            multinode.NodeSet.for_nodes(p.nodes_section), models.resolve(p.model), [p.ray_port], backend="ray"
        )
    text = str(refused.value)
    assert "node1 (ray-1): Ray is not installed for /usr/bin/python3; pip install ray==" in text, text
    assert "node1 (ray-1): vllm missing, but node0 (this machine) has" in text, text
    assert ray_processes() == []


def test_a_sigterm_while_the_nodes_join_stops_the_cluster_it_started(namespaces, tmp_path):
    """servebook's SIGTERM handler raises Interrupted in the launching thread (runner.py); raised here by an alarm
    while the head is starting or node1 is joining, before any vLLM started: every Ray process is stopped."""

    def interrupt(*_):
        raise Interrupted("SIGTERM", 143)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(12)
    try:
        with pytest.raises(Interrupted):
            ray_nodes.launch_on(cluster_of(namespaces), config(PORT), tmp_path, log=print)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert server.registered(PORT) is None
    assert ray_processes() == []
