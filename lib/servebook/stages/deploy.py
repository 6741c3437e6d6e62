"""Stage 07: render, verify, prove and (only when asked) install the service: the units of the shape the launch
started (its :class:`servebook.topology.Topology`), from the parts in :mod:`servebook.service`."""

from __future__ import annotations

from pathlib import Path

from servebook import results, topology
from servebook.errors import DeployFailed
from servebook.params import Params
from servebook.records import DeployRecord, LaunchRecord, NcclTuningRecord


def run(p: Params, run_dir: str | Path) -> DeployRecord:
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, DeployRecord)  # a rerun never leaves the last attempt's record looking current
    launch = results.require(run_dir, LaunchRecord, "deploy")
    tuned = results.read(run_dir, NcclTuningRecord)
    name = p.deploy_name or launch.served_model_name.replace("/", "-")
    shape = topology.kind(launch.topology)  # the units follow what the launch started, not today's params
    record = shape.deploy_units(p.deploy_section, run_dir, launch, name, tuned.recommended_env if tuned else None)
    results.write(run_dir, record)
    return record


def check(record: DeployRecord, p: Params) -> None:
    problems = list(record.access_problems)
    if not record.verify.ran and p.deploy_install:
        problems.append(f"{record.verify.output}: the unit cannot be verified before it is installed")
    elif record.verify.ran and not record.verify.ok:
        problems.append("systemd-analyze verify: " + "; ".join(record.verify.blocking or [record.verify.output]))
    watchdog = record.watchdog_verify
    if watchdog and watchdog.ran and not watchdog.ok:
        problems.append(
            "the watchdog's unit, systemd-analyze verify: " + "; ".join(watchdog.blocking or [watchdog.output])
        )
    for node_unit in [*record.node_units, *record.replica_units]:
        if node_unit.verify.ran and not node_unit.verify.ok:
            blocking = node_unit.verify.blocking or [node_unit.verify.output]
            problems.append(f"{node_unit.node}'s unit, systemd-analyze verify: " + "; ".join(blocking))
    dry = record.dry_run
    if dry and dry.post_start and dry.post_start.returncode:
        problems.append("the post-start wait failed: " + dry.post_start.output)
    if dry and dry.skipped:
        problems.append("the pre-start check refused: " + dry.pre_start.output)
    if dry and dry.smoke_test and not dry.smoke_test.passed:
        problems.append("the smoke test against the dry-run service failed")
    if dry and dry.keyless_status not in (None, 401):
        problems.append(
            f"the dry-run service answered a request without the API key with {dry.keyless_status}: the unit's "
            "environment file did not give vLLM its key"
        )
    if record.installed and not record.installed.enabled:
        problems.append("systemctl enable --now failed: " + record.installed.output[-300:])
    if problems:
        raise DeployFailed("deploy:\n  - " + "\n  - ".join(problems))


def summary(record: DeployRecord) -> str:
    if not record.verify.ran:
        verified = "**not verified**: install systemd (apt-get install systemd)"
    else:
        verified = "verified" if record.verify.ok else "**did not verify**"
    proven = ""
    if record.dry_run and record.dry_run.post_start:
        ok = (
            record.dry_run.post_start.returncode == 0 and record.dry_run.smoke_test and record.dry_run.smoke_test.passed
        )
        proven = f"; dry run as {record.run_as} ready and answering" if ok else "; **dry run failed**"
        if ok and record.dry_run.keyless_status == 401:
            proven += " with its key (401 without it)"
    elif record.dry_run_skipped.startswith("deploy_dry_run is false"):
        proven = "; no dry run (deploy_dry_run: false)"
    if record.access_problems:
        proven = f"; **its user cannot start it**: {record.access_problems[0]}"
    installed = "; installed" if record.installed and record.installed.enabled else ""
    nodes = ""
    if record.replica_units:
        nodes = f", requiring {len(record.replica_units)} replica unit(s) it starts first and stops with it"
        proven = "; no dry run of a router and its replicas (install proves them)" if not installed else proven
    if record.node_units:
        nodes = f", with {len(record.node_units)} worker node unit(s) it starts and stops over SSH"
        proven = "; no dry run across nodes (install proves them)" if not installed else proven
    return (
        f"`{record.unit_name}` (TimeoutStartSec={record.timeout_start_s}, load {record.load_seconds:.0f} s "
        f"{record.load_source}){nodes}, {verified}{proven}{installed}"
    )
