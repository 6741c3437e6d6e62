"""servebook's runs in the layout of `vllm bench serve --save-result`, and vLLM's files read back for compare."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servebook import vllm_format
from servebook.errors import ServebookError
from servebook.loadgen import RequestRecord
from servebook.stages.benchmark import load_run

VLLM_RESULT = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-bench" / "vllm-0.25.0-h200-bf16-tp2-c16.json"


def request(i, send, first, end, tokens=4, warmup=False):
    r = RequestRecord(index=i, level="c2r0", warmup=warmup, arrival=send, send=send, expected_output=tokens)
    step = (end - first) / (tokens - 1)
    r.first_chunk, r.end = first, end
    r.chunk_times = [first + k * step for k in range(tokens)]
    r.chunk_tokens, r.completion_tokens, r.prompt_tokens = [1] * tokens, tokens, 8
    return r


def test_a_run_is_written_with_vllms_fields_and_definitions():
    recs = [
        request(0, 0.0, 0.0, 0.5, warmup=True),  # warm-up: not part of the result
        request(1, 1.0, 1.1, 1.4),  # TTFT 100 ms, TPOT 100 ms, E2EL 400 ms
        request(2, 1.0, 1.3, 1.9),  # TTFT 300 ms, TPOT 200 ms, E2EL 900 ms
    ]
    out = vllm_format.result_json(recs, model="m", tokenizer="/t", endpoint="completions", max_concurrency=2)
    ours, theirs = set(out), set(json.loads(VLLM_RESULT.read_text()))
    assert ours <= theirs and theirs - ours == {"rtfx"}  # rtfx is vLLM's speech-to-text measure
    assert out["num_prompts"] == out["completed"] == 2 and out["failed"] == 0 and out["request_rate"] == "inf"
    assert out["duration"] == pytest.approx(0.9) and out["total_output_tokens"] == 8
    assert out["output_throughput"] == pytest.approx(8 / 0.9)
    assert out["median_ttft_ms"] == pytest.approx(200) and out["p99_ttft_ms"] == pytest.approx(298)
    assert out["mean_tpot_ms"] == pytest.approx(150) and out["median_e2el_ms"] == pytest.approx(650)
    assert out["median_itl_ms"] == pytest.approx(150)  # gaps between chunks: three of 100 ms, three of 200 ms
    assert out["max_concurrent_requests"] == 2 and out["max_output_tokens_per_s"] == 8


def test_compare_reads_vllms_own_result_files(tmp_path):
    label, levels = load_run(VLLM_RESULT)  # saved on two H200s, 2026-12-01
    assert "vllm bench serve" in label and list(levels.concurrency) == [16]
    assert levels.output_throughput[0] == pytest.approx(7618.22, rel=1e-4)
    assert levels.per_user_tok_s[0] == pytest.approx(1000 / 1.87268, rel=1e-4) and levels.ttft_p50_ms[
        0
    ] == pytest.approx(21.97, rel=1e-3)
    folder = tmp_path / "vllm-runs"
    folder.mkdir()
    for c, tok in ((16, 7000.0), (64, 21000.0), (64, 23000.0)):
        data = json.loads(VLLM_RESULT.read_text()) | {"max_concurrency": c, "output_throughput": tok}
        (folder / f"c{c}-{tok:.0f}.json").write_text(json.dumps(data))
    _, levels = load_run(folder)
    assert list(levels.concurrency) == [16, 64] and list(levels.output_throughput) == [7000.0, 22000.0]


def test_a_file_that_is_not_a_vllm_result_is_named_with_the_fix(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ServebookError, match=r"notes.json: not a `vllm bench serve --save-result` file \(no completed"):
        load_run(bad)
    cli = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "compare", str(bad), str(VLLM_RESULT)], capture_output=True, text=True
    )
    assert cli.returncode != 0 and "notes.json: not a `vllm bench serve --save-result` file" in cli.stderr
    assert "Traceback" not in cli.stderr
