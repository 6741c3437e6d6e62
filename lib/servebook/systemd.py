"""A systemd service for the chosen configuration that starts only when ready and cleans up after itself.

The traps it avoids: ``KillMode=process`` leaves
orphaned ``VLLM::`` engine processes on the GPUs, a 90 s default start timeout kills a
36-minute load, ``Restart=always`` relaunches into an out-of-memory loop while leftovers
hold memory, and ``Type=simple`` reports "started" long before the model answers.  So:
``Type=exec``; a pre-start check that the GPUs and the port are free; a post-start step
that waits for ``/health`` so ``systemctl start`` returns only when the model answers;
a start timeout derived from the measured (or predicted) load time; the whole control
group killed on stop; ``Restart=on-failure`` with a back-off and a start limit sized for
long loads.  The API key lives in a root-only environment file, never in the unit.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from servebook import remote
from servebook.errors import DeployFailed

START_MARGIN = 1.5  # TimeoutStartSec = 1.5 x the load time, plus a fixed allowance
START_ALLOWANCE_S = 300
STOP_TIMEOUT_S = 120  # SIGTERM grace before SIGKILL; vLLM's worker shutdown takes about 5 s plus in-flight requests
RESTART_SEC = 30
START_BURST = 3
SECRET_VARS = ("VLLM_API_KEY", "HF_TOKEN")


@dataclass
class NodeUnit:
    """A worker node's unit, which the head's unit starts and stops over SSH."""

    node: str
    ssh: str  # destination from the service user's SSH configuration; empty: this machine
    unit_name: str


@dataclass
class UnitSpec:
    name: str  # servebook-<name>.service
    description: str
    command: list[str]  # the exact serving command the launch stage validated
    environment: dict[str, str]  # non-secret variables
    # the environment file's variables, each filled at install from the installing shell's variable named here
    # (VLLM_API_KEY from whatever api_key_env names)
    secret_sources: dict[str, str]
    url: str
    port: int
    gpu_ids: list[int]
    device: str
    load_seconds: float  # measured, or predicted from the checkpoint size
    load_source: str  # "measured" or "predicted"
    servebook: list[str]  # the command that runs servebook's CLI on the target host
    user: str = "vllm"
    state_dir: str = ""
    role: str = "server"  # "server" (serves the API), or "worker" (a headless node of a multi-node server)
    worker_units: list[NodeUnit] = field(default_factory=list)  # the head's: the other nodes' units
    ssh_config: str = ""
    ray_address: str = ""  # distributed_backend ray: the head's vLLM waits until Ray counts ray_nodes alive here
    ray_nodes: int = 0
    ray: bool = False  # a Ray node's unit, or the server on Ray: both meet in /tmp/ray (sockets, session)
    requires: list[str] = field(default_factory=list)  # a router's: its replicas' units, up before it starts
    # a router's replicas on other machines: each started over SSH (returning once it answers) before the router,
    # stopped after it
    remote_units: list[NodeUnit] = field(default_factory=list)
    part_of: str = ""  # a replica's: the router's unit, whose stop and restart reach it
    # a router's: API servers its required units start elsewhere without waiting (a hybrid server's other nodes),
    # each waited for before the router starts
    wait_urls: list[str] = field(default_factory=list)

    @property
    def unit_name(self) -> str:
        return f"servebook-{self.name}.service"

    @property
    def env_file(self) -> str:
        return f"/etc/servebook/{self.name}.env"

    @property
    def timeout_start_s(self) -> int:
        return int(math.ceil(self.load_seconds * START_MARGIN + START_ALLOWANCE_S))

    @property
    def start_limit_interval_s(self) -> int:
        # a window that holds START_BURST complete attempts, so a slow load is never mistaken for a crash loop
        return START_BURST * (self.timeout_start_s + RESTART_SEC) + 60


def _quote(arg: str) -> str:
    """systemd's quoting for Exec lines: double quotes, with %, $ and \\ escaped."""
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./\-]+", arg) and "%" not in arg and "$" not in arg:
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def exec_line(args: list[str]) -> str:
    return " ".join(_quote(a) for a in args)


def _on_node(unit: NodeUnit, ssh_config: str, *args: str) -> list[str]:
    if not unit.ssh:
        return ["/usr/bin/systemctl", *args]
    ssh = ["/usr/bin/ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"] + (
        ["-F", ssh_config] if ssh_config else []
    )
    return [*ssh, unit.ssh, "systemctl", *args]


def _start_lines(u: UnitSpec) -> tuple[str, str]:
    """What runs before and after ExecStart: the checks and waits of a server, or nothing on a worker node."""
    if u.role == "worker":
        return (
            "# a worker node of a multi-node server: the head's unit starts and stops this one over SSH; it serves\n"
            "# no API, and the head's /health answers only once this node's ranks have joined",
            "",
        )
    gpus = ",".join(str(i) for i in u.gpu_ids)
    check = [*u.servebook, "gpu-check", "--port", str(u.port)] + (
        ["--gpus", gpus] if gpus and u.device == "cuda" else []
    )
    wait = [*u.servebook, "wait-ready", "--url", u.url, "--timeout", str(u.timeout_start_s)]
    pre = (
        "# refuse to start while anything holds the GPUs or the port (leftovers from a killed server)\n"
        f"ExecStartPre={exec_line(check)}"
    )
    if u.worker_units:
        pre += (
            "\n# the other nodes first, without waiting (their vLLM waits for this one); the service user reaches each\n"
            "# over SSH as a user allowed to start that unit"
        )
        pre += "".join(
            f"\nExecStartPre={exec_line(_on_node(w, u.ssh_config, 'start', '--no-block', w.unit_name))}"
            for w in u.worker_units
        )
    if u.ray_address:
        ray_wait = [*u.servebook, "ray-wait", "--address", u.ray_address, "--nodes", str(u.ray_nodes)]
        pre += (
            "\n# vLLM places its workers on the Ray cluster as it finds it: wait until every node has joined (a node's\n"
            f"# `ray start` that found no head yet fails and is restarted by its unit)\nExecStartPre={exec_line(ray_wait)}"
        )
    if u.remote_units:
        pre += (
            "\n# its replicas on other machines, one after another: each start returns once that replica's /health\n"
            "# answers (its own ExecStartPost); the service user reaches each over SSH as a user allowed to start it"
        )
        pre += "".join(
            f"\nExecStartPre={exec_line(_on_node(w, u.ssh_config, 'start', w.unit_name))}" for w in u.remote_units
        )
    if u.wait_urls:
        pre += "\n# every node's API server answers before the router sends it a request"
        pre += "".join(
            f"\nExecStartPre={exec_line([*u.servebook, 'wait-ready', '--url', url, '--timeout', str(u.timeout_start_s)])}"
            for url in u.wait_urls
        )
    post = (
        "# systemctl start returns only when /health answers 200"
        + (", which vLLM allows once every node's ranks have joined" if u.worker_units else "")
        + f"\nExecStartPost={exec_line(wait)}"
    )
    if u.remote_units:
        post += "\n# a stop (or a failure) of the router stops its replicas on the other machines"
        post += "".join(
            f"\nExecStopPost=-{exec_line(_on_node(w, u.ssh_config, 'stop', w.unit_name))}" for w in u.remote_units
        )
    if u.worker_units:
        post += "\n# a stop (or a failure) of this unit reaches every node"
        post += "".join(
            f"\nExecStopPost=-{exec_line(_on_node(w, u.ssh_config, 'stop', w.unit_name))}" for w in u.worker_units
        )
    return pre, post


def _dependency_lines(u: UnitSpec) -> str:
    """A router and its replicas as units: starting the router starts every replica first and waits for each to be
    started, which their ExecStartPost makes mean answering; stopping or restarting the router does the same to
    them."""
    lines = []
    if u.requires:
        lines += ["# what it routes to first: each unit's start returns only once its /health answers",
                  f"Requires={' '.join(u.requires)}"]  # fmt: skip
    if u.part_of:
        lines += ["# stopped and restarted with the router in front of it", f"PartOf={u.part_of}"]
    return "\n".join(lines) + ("\n" if lines else "")


def render_unit(u: UnitSpec) -> str:
    pre, post = _start_lines(u)
    state = u.state_dir or f"/var/lib/servebook/{u.name}"
    env_lines = "\n".join(f"Environment={_quote(f'{k}={v}')}" for k, v in sorted(u.environment.items()))
    private_tmp = (
        "# Ray's node and the vLLM that joins it meet in /tmp/ray (the raylet's sockets): no private /tmp\nPrivateTmp=no"
        if u.ray
        else "PrivateTmp=yes"
    )
    return f"""# Rendered by servebook from the configuration its launch stage validated.
# Load time {u.load_seconds:.0f} s ({u.load_source}); TimeoutStartSec = {START_MARGIN} x load + {START_ALLOWANCE_S} s.
[Unit]
Description={u.description}
Documentation=https://docs.vllm.ai/
After=network-online.target{"".join(" " + r for r in u.requires)}
Wants=network-online.target
{_dependency_lines(u)}# A window that holds {START_BURST} complete long loads: a slow start is not a crash loop.
StartLimitIntervalSec={u.start_limit_interval_s}
StartLimitBurst={START_BURST}

[Service]
# exec: systemd reports a failure to start the binary at once{"" if u.role == "worker" else "; readiness comes from ExecStartPost"}.
Type=exec
User={u.user}
Group={u.user}
WorkingDirectory={state}
StateDirectory=servebook/{u.name}
{env_lines}
Environment=HOME={state}
Environment=HF_HOME={state}/hf
Environment=VLLM_CACHE_ROOT={state}/vllm
# secrets (the API key) live here, root-only, never in this unit
EnvironmentFile=-{u.env_file}
{pre}
ExecStart={exec_line(u.command)}
{post}
TimeoutStartSec={u.timeout_start_s}
# stop: SIGTERM to every process of the unit (API server, EngineCore, workers), SIGKILL after the grace
KillMode=control-group
KillSignal=SIGTERM
SendSIGKILL=yes
TimeoutStopSec={STOP_TIMEOUT_S}
Restart=on-failure
RestartSec={RESTART_SEC}
LimitNOFILE=65536
LimitMEMLOCK=infinity
StandardOutput=journal
StandardError=journal
SyslogIdentifier=servebook-{u.name}
# hardening that still lets vLLM read the model, use the GPUs and write its caches
NoNewPrivileges=yes
{private_tmp}
ProtectSystem=full
ProtectHome=read-only
ReadWritePaths={state}
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
"""


WATCHDOG_EVERY_S = 60  # how often the watchdog asks the service for a token
WATCHDOG_TIMEOUT_S = 60  # a hung engine answers /health but no token: this long without one restarts the service


def watchdog_names(u: UnitSpec) -> tuple[str, str]:
    return f"servebook-{u.name}-watchdog.service", f"servebook-{u.name}-watchdog.timer"


def render_watchdog(u: UnitSpec) -> tuple[str, str]:
    """A timer and the check it runs: a one-token completion through the service's port, and a restart of the
    service when none comes back. systemd restarts a service whose process died (Restart=on-failure); an engine
    that hangs with /health answering 200 (vllm-project/vllm#39863) only this notices."""
    service, _timer = watchdog_names(u)
    check = [*u.servebook, "watchdog", "--url", u.url, "--unit", u.unit_name, "--timeout", str(WATCHDOG_TIMEOUT_S)]
    unit = f"""# Rendered by servebook: restarts {u.unit_name} when its engine stops producing tokens.
[Unit]
Description=Liveness of {u.unit_name}: a token, not only /health
After={u.unit_name}

[Service]
Type=oneshot
# the service's key, to ask for a token (root-only file)
EnvironmentFile=-{u.env_file}
ExecStart={exec_line(check)}
TimeoutStartSec={WATCHDOG_TIMEOUT_S + 60}
"""
    timer = f"""# Rendered by servebook: runs {service} while {u.unit_name} runs.
[Unit]
Description=Ask {u.unit_name} for a token every {WATCHDOG_EVERY_S} s
PartOf={u.unit_name}

[Timer]
OnActiveSec={WATCHDOG_EVERY_S}
OnUnitInactiveSec={WATCHDOG_EVERY_S}
AccuracySec=5

[Install]
WantedBy={u.unit_name}
"""
    return unit, timer


def render_env_file(u: UnitSpec, values: dict[str, str] | None = None) -> str:
    """The environment file; without ``values`` the secrets are left empty (filled at install time)."""
    lines = [f"# {u.unit_name}: secrets only. Mode 0600, owner root.", ""]
    for name, source in u.secret_sources.items():
        value = (values or {}).get(name, "")
        lines.append(f"{name}={value}" if value else f"# {name}= (filled at install from ${source})")
    return "\n".join(lines) + "\n"


def secret_values(u: UnitSpec) -> dict[str, str]:
    """The environment file's values, read from the variables the unit names (``api_key_env``'s, not a guess)."""
    missing = [source for source in u.secret_sources.values() if source not in os.environ]
    if missing:
        raise DeployFailed(
            f"{u.unit_name} needs {', '.join(missing)} in the environment for its key; export "
            f"{' and '.join(missing)} (the server's API key) and deploy again"
        )
    return {name: os.environ[source] for name, source in u.secret_sources.items()}


class Verified(BaseModel):
    """``systemd-analyze verify``'s verdict; ``ran`` is false where systemd is not installed."""

    ran: bool
    ok: bool
    output: str
    returncode: int | None = None
    blocking: list[str] = []


class Installed(BaseModel):
    enabled: bool
    output: str


def verify(unit_path: Path) -> Verified:
    """``systemd-analyze verify`` on a rendered unit (works without a running systemd)."""
    exe = shutil.which("systemd-analyze")
    if not exe:
        return Verified(
            ran=False, ok=False, output="not verified: systemd-analyze is not installed (apt-get install systemd)"
        )
    proc = subprocess.run([exe, "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
    out = (proc.stdout + proc.stderr).strip()
    # A wrong value is only "ignored" by systemd (exit 0) and would silently change the unit: treat it as an error.
    # Paths of the target host (the venv, the user) may not exist on this machine: those are not.
    serious = [
        line
        for line in out.splitlines()
        if re.search(
            r"(Failed to parse|Unknown (key|section|lvalue)|[Bb]ad unit file|fatal error|Invalid|Missing '=')", line
        )
        and not re.search(r"(is not executable|No such file|Failed to resolve user|does not exist)", line)
    ]
    return Verified(
        ran=True, ok=proc.returncode == 0 and not serious, returncode=proc.returncode, output=out, blocking=serious
    )


# what a benchmark needed that a production service must not have: VLLM_SERVER_DEV_MODE opens vLLM's development
# endpoints (/reset_prefix_cache, /sleep, ...) to anyone who can reach the port
DEVELOPMENT_ONLY = {
    "VLLM_SERVER_DEV_MODE": "it opens vLLM's development endpoints (/reset_prefix_cache, /sleep) to clients"
}


def user_exists(user: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def access_problems(user: str, paths: dict[str, str]) -> list[str]:
    """What ``user`` cannot reach of ``paths`` (what -> path: a program it must run, or a folder or file it must
    read), checked as that user with ``runuser``, each naming the path that blocks it and the fix."""
    problems = []
    for what, path in paths.items():
        target = Path(path)
        if _can(user, target):
            continue
        blocked = next((p for p in [*reversed(target.parents), target] if not _can(user, p)), target)
        problems.append(
            f"{what} {path}: user {user} cannot {'enter' if blocked != target else 'use'} {blocked}; put it where the "
            f"service's user reaches it (e.g. under /opt or /data, readable by {user}), or set deploy_user"
        )
    return problems


def _can(user: str, path: Path) -> bool:
    """Whether ``user`` can use ``path``: enter and list a folder, read a file, run a program."""
    flags = ["-r", "-x"] if path.is_dir() or os.access(path, os.X_OK) else ["-r"]
    return all(
        subprocess.run(["runuser", "-u", user, "--", "test", flag, str(path)], capture_output=True).returncode == 0
        for flag in flags
    )


def as_user(user: str, command: list[str]) -> list[str]:
    """``command`` run as ``user`` (with that user's groups), as systemd's User= runs it."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *command]


def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()


def install(u: UnitSpec, unit_text: str) -> Installed:
    """Write the unit and the root-only environment file, create the user, enable and start. Needs root and systemd."""
    if not systemd_running():
        raise DeployFailed(
            "systemd is not running on this host (a container?); copy the rendered unit to a host that runs it, "
            "or set deploy_install: false"
        )
    if os.geteuid() != 0:
        raise DeployFailed("installing a system unit needs root; run as root, or set deploy_install: false")
    values = secret_values(u)
    if subprocess.run(["id", "-u", u.user], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--groups", "video", u.user],
            check=True,
        )
    env = Path(u.env_file)
    env.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(render_env_file(u, values))
    Path(f"/etc/systemd/system/{u.unit_name}").write_text(unit_text)
    for name, text in zip(watchdog_names(u), render_watchdog(u), strict=True):
        Path(f"/etc/systemd/system/{name}").write_text(text)
    subprocess.run(["systemctl", "daemon-reload"], check=True)
    subprocess.run(["systemctl", "enable", watchdog_names(u)[1]], capture_output=True)
    proc = subprocess.run(
        ["systemctl", "enable", "--now", u.unit_name], capture_output=True, text=True, timeout=u.timeout_start_s + 60
    )
    return Installed(enabled=proc.returncode == 0, output=(proc.stdout + proc.stderr)[-2000:])


def install_remote(u: UnitSpec, unit_text: str, ssh: str, ssh_config: str = "") -> Installed:
    """A unit on another machine, over SSH: its user, its root-only environment file (the key over SSH's stdin,
    in no command line), the unit, enabled; started by the unit that needs it (a router's ExecStartPre)."""
    values = secret_values(u)
    steps = [
        (f"id -u {u.user} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "
         f"--groups video {u.user}", None),
        (f"umask 077 && mkdir -p {shlex.quote(str(Path(u.env_file).parent))} && cat > {shlex.quote(u.env_file)}",
         render_env_file(u, values)),
        (f"cat > /etc/systemd/system/{u.unit_name} && systemctl daemon-reload && systemctl enable {u.unit_name}",
         unit_text),
    ]  # fmt: skip
    said = []
    for script, given in steps:
        done = remote.run(ssh, script, ssh_config, timeout_s=60, input_text=given)
        said.append((done.stdout + done.stderr).strip())
        if done.returncode:
            return Installed(enabled=False, output=f"on {ssh}: {script.split(' &&')[0]} failed: {said[-1][-500:]}")
    return Installed(enabled=True, output="; ".join(x for x in said if x)[-2000:])


def shell_line(args: list[str]) -> str:
    return shlex.join(args)
