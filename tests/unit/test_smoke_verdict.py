"""Issue #41 point 5: two temperature-0 answers that differ are a warning with its cause, never the smoke test's
failure; a real fault still fails it."""

from servebook import client
from servebook.records import SmokeTestRecord
from servebook.stages import smoke_test


def record(*checks: client.Check) -> SmokeTestRecord:
    stream = client.StreamTiming(
        ttft_ms=40.0, e2el_ms=400.0, completion_tokens=32, chunks=32, client_decode_tok_s=90.0, decode_tok_s=90.0,
        end_to_end_tok_s=80.0,
    )  # fmt: skip
    answer = client.Answer(text="x", finish_reason="length", usage={"completion_tokens": 8})
    return SmokeTestRecord(
        url="http://127.0.0.1:8000", model="m", models=["m"], chat=answer, completion=answer, stream=stream,
        metrics={}, checks=list(checks), passed=all(c.ok or c.warning for c in checks),
    )  # fmt: skip


def test_answers_that_differ_at_temperature_zero_are_a_warning_with_their_cause():
    differs = client.Check(
        check="chat completion is deterministic at temperature 0", ok=False, warning=True,
        detail="'' != ' m': the second request reused the first one's prefix cache, and vLLM does not promise...",
    )  # fmt: skip
    found = record(client.Check(check="models lists the served name", ok=True, detail=""), differs)
    assert found.passed and found.failed() == [] and found.warnings() == [differs]
    client.raise_on_failure(found)  # no exception: a warning is no failure
    said = smoke_test.summary(found)
    assert said.startswith("passed, with a warning") and "prefix cache" in said


def test_a_real_fault_still_fails():
    broken = client.Check(check="stream honours max_tokens", ok=False, detail="3 of 32 tokens")
    found = record(broken)
    assert not found.passed and found.failed() == [broken]
    try:
        client.raise_on_failure(found)
    except client.SmokeTestFailed as exc:
        assert "stream honours max_tokens" in str(exc)
    else:
        raise AssertionError("a broken stream passed")


def test_the_tables_say_passed_warning_or_failed_and_count_in_whole_numbers():
    """Issue #41 point 9: the checks read `True`, the counters `92.0`."""
    shown = record(
        client.Check(check="models lists the served name", ok=True, detail="m"),
        client.Check(check="deterministic at temperature 0", ok=False, warning=True, detail="differs"),
        client.Check(check="usage counts the tokens", ok=False, detail="none"),
    ).model_copy(update={"metrics": {"prompt_tokens_total": 92.0, "gpu_cache_usage_perc": 0.25}})
    checks = smoke_test.checks_table(shown)
    assert list(checks["result"]) == ["passed", "warning", "failed"] and checks.index.name == "check"
    gauges = smoke_test.gauges_table(shown)
    assert (
        str(gauges.loc["prompt_tokens_total", "value"]) == "92" and gauges.loc["gpu_cache_usage_perc", "value"] == 0.25
    )
