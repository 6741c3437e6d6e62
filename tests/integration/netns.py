"""Two machines on one: network namespaces whose only address is a veth on a bridge (10.231.N.x/24), each with an
OpenSSH server, so that a process started there over SSH sees what it would on a node of its own: one routable
interface and no loopback route to the others. Ray registers the address it finds routable, so two Ray nodes on one
host's loopback would both register the host's address (distributed-anchors.md §1); here each registers its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.integration import sshnode


def available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or not sshnode.available():
        return False
    probe = subprocess.run(["ip", "netns", "add", "sb-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "sb-probe"], capture_output=True)
    return probe.returncode == 0


def _ip(*args: str, netns: str = "") -> None:
    argv = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class Namespaces:
    """Namespaces ``names`` on bridge ``bridge``; ``addresses[i]`` is namespace i's address, ``gateway`` this host's."""

    names: list[str]
    addresses: list[str]
    bridge: str
    gateway: str
    sshd: list[subprocess.Popen[bytes]]
    ssh_config: Path

    def close(self) -> None:
        for proc in self.sshd:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def create(folder: Path, count: int = 2, subnet: int = 231, tag: str = "ray") -> Namespaces:
    """``count`` namespaces ``sb-TAG-i`` with sshd on port 22 of each; hosts ``TAG-i`` in the returned SSH config."""
    names = [f"sb-{tag}-{i}" for i in range(count)]
    addresses = [f"10.{subnet}.0.{i + 1}" for i in range(count)]
    bridge, gateway = f"sb{tag}br", f"10.{subnet}.0.254"
    for i, name in enumerate(names):  # left behind by an interrupted run, or by a namespace whose teardown lags
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # (its TIME_WAIT sockets keep it a while)
        subprocess.run(["ip", "link", "del", f"sb{tag}{i}h"], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{gateway}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    configs, procs = [], []
    try:
        for i, (name, address) in enumerate(zip(names, addresses, strict=True)):
            _ip("netns", "add", name)
            host_end, ns_end = f"sb{tag}{i}h", f"sb{tag}{i}n"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("link", "set", ns_end, "netns", name)
            _ip("addr", "add", f"{address}/24", "dev", ns_end, netns=name)
            _ip("link", "set", ns_end, "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)
            proc, config = sshnode.start(folder / name, address=address, port=22, alias=f"{tag}-{i}", netns=name)
            procs.append(proc)
            configs.append(config.read_text())
    except BaseException:
        Namespaces(names, addresses, bridge, gateway, procs, folder / "ssh_config").close()
        raise
    ssh_config = folder / "ssh_config"
    ssh_config.write_text("".join(configs))
    return Namespaces(names, addresses, bridge, gateway, procs, ssh_config)
