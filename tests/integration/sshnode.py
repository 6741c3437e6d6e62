"""A second node on this machine: Debian's OpenSSH server on a loopback address of its own (127.0.0.3), reached
with a key and a client configuration that live in a temporary folder, as a user's own SSH setup would be."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def available() -> bool:
    return Path(SSHD).is_file() and shutil.which("ssh") is not None and shutil.which("ssh-keygen") is not None


def start(
    folder: Path, address: str = "127.0.0.3", port: int = 2222, alias: str = "node-b", netns: str = ""
) -> tuple[subprocess.Popen[bytes], Path]:
    """sshd on ``address:port`` (inside network namespace ``netns`` where given); returns it and an SSH client
    config in which ``alias`` reaches it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    (folder / "authorized_keys").write_text((folder / "user_key.pub").read_text())
    (folder / "authorized_keys").chmod(0o600)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
    server_config = folder / "sshd_config"
    server_config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {folder / 'host_key'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"PidFile {folder / 'sshd.pid'}\nAcceptEnv none\n"
    )
    inside = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen(
        [*inside, SSHD, "-D", "-e", "-f", str(server_config)], stderr=open(folder / "sshd.log", "wb")
    )
    client_config = folder / "ssh_config"
    client_config.write_text(
        f"Host {alias}\n  HostName {address}\n  Port {port}\n  User root\n  IdentityFile {folder / 'user_key'}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((address, port)) == 0:
                return proc, client_config
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sshd did not start: {(folder / 'sshd.log').read_text()[-500:]}")
