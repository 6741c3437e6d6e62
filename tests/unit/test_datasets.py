"""Dataset workloads: ShareGPT and custom JSONL read as vLLM's benchmark reads them, each request with its own
lengths, and every bad file refused before a request is sent, naming the file and the first bad record."""

import json
from pathlib import Path

import pytest

from servebook import datasets, loadgen, models, params
from servebook.datasets import Prompt
from servebook.errors import ParamsError

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
SHAREGPT, JSONL = HERE / "sharegpt-small.json", HERE / "custom-small.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return loadgen.load_tokenizer(str(models.build_tiny_model()))


def test_sharegpt_takes_each_first_exchange_and_skips_records_without_an_answer(tokenizer):
    ds = datasets.load(SHAREGPT, tokenizer, max_model_len=1024, output_len=24)
    records = json.loads(SHAREGPT.read_text())
    assert ds.format == "sharegpt" and len(ds.prompts) == 24 and ds.skipped == 1
    first = records[0]["conversations"]
    assert ds.prompts[0].text == first[0]["value"]
    assert ds.prompts[0].input_len == len(tokenizer.encode(first[0]["value"]))
    answer = len(tokenizer.encode(first[1]["value"], add_special_tokens=False))
    assert ds.prompts[0].output_len == min(answer, 24)
    assert ds.capped == sum(
        len(tokenizer.encode(r["conversations"][1]["value"], add_special_tokens=False)) > 24
        for r in records
        if len(r["conversations"]) >= 2
    )
    assert ds.capped > 0 and max(p.output_len for p in ds.prompts) == 24
    assert len({p.input_len for p in ds.prompts}) > 10  # lengths vary, as real traffic does
    assert "24 requests from sharegpt-small.json (sharegpt)" in ds.summary() and "capped at 24" in ds.summary()


def test_jsonl_lines_carry_their_own_output_lengths(tokenizer):
    ds = datasets.load(JSONL, tokenizer, max_model_len=1024, output_len=64)
    lines = [json.loads(line) for line in JSONL.read_text().splitlines()]
    assert ds.format == "jsonl" and [p.output_len for p in ds.prompts] == [r["output_tokens"] for r in lines]
    assert ds.capped == 0
    cursor = datasets.Cursor(ds.prompts[:3])
    assert cursor.take(2) == ds.prompts[:2] and cursor.take(2) == [ds.prompts[2], ds.prompts[0]]


@pytest.mark.parametrize(
    "content, fmt, message",
    [
        ('[{"id": 1, "conversations": "hi"}]', "auto", "record 0: no 'conversations' list"),
        ("[1, 2", "auto", "not valid JSON"),
        ('{"conversations": []}', "sharegpt", "a ShareGPT file is a JSON list of records, this is a dict"),
        ('{"prompt": "a"}\n{"text": "b"}\n', "auto", "line 2: no 'prompt' string"),
        ('{"prompt": "a", "output_tokens": 0}\n', "jsonl", "line 1: output_tokens must be a positive integer, not 0"),
        ('{"prompt": "a"}\nnot json\n', "auto", "line 2: not a JSON object"),
    ],
)
def test_a_bad_file_names_its_first_bad_record(tmp_path, content, fmt, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(datasets.DatasetError, match=message) as caught:
        datasets.check(bad, fmt)
    assert str(bad) in str(caught.value)


def test_params_refuse_a_missing_or_broken_dataset_before_anything_starts(tmp_path):
    with pytest.raises(ParamsError, match=r"bench_dataset: no file .*nowhere.jsonl; give the path"):
        params.validate({"model": "builtin:tiny-qwen3-moe", "bench_dataset": str(tmp_path / "nowhere.jsonl")})
    good = params.validate({"model": "builtin:tiny-qwen3-moe", "bench_dataset": str(JSONL)})
    assert good.bench_dataset == str(JSONL)


def test_a_prompt_longer_than_max_model_len_is_refused_by_name(tokenizer, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "word " * 400}) + "\n")
    with pytest.raises(datasets.DatasetError, match=r"long.jsonl, line 2: its prompt \(\d+ tokens\) and output"):
        datasets.load(long, tokenizer, max_model_len=256, output_len=16)


def test_multi_turn_needs_the_chat_endpoint_and_no_dataset():
    with pytest.raises(ParamsError, match="bench_turns 3 sends conversations, which only the chat endpoint takes"):
        params.validate({"model": "builtin:tiny-qwen3-moe", "bench_turns": 3})
    with pytest.raises(ParamsError, match="leave bench_dataset empty"):
        params.validate(
            {"model": "builtin:tiny-qwen3-moe", "bench_turns": 3, "bench_endpoint": "chat", "bench_dataset": str(JSONL)}
        )
    assert (
        params.validate({"model": "builtin:tiny-qwen3-moe", "bench_turns": 3, "bench_endpoint": "chat"}).bench_turns
        == 3
    )


def test_a_long_context_mix_carries_its_share_evenly_at_exact_lengths(tokenizer):
    """A quarter of the requests carry 200 prompt tokens: every fourth one, so any window holds its share; each
    long request is a request of its own length (its record expects 200), the rest the workload's 32."""
    maker = loadgen.PromptMaker(tokenizer, seed=4)
    workload = loadgen.Workload(input_len=32, output_len=8, long_input_len=200, long_share=0.25)
    prompts = loadgen.synthetic_prompts(maker, 16, workload)
    long = [i for i, p in enumerate(prompts) if isinstance(p, Prompt)]
    assert long == [3, 7, 11, 15]
    long_prompts = [p for p in prompts if isinstance(p, Prompt)]
    assert all(p.input_len == 200 and p.output_len == 8 and maker.count(p.text) == 200 for p in long_prompts)
    assert {maker.count(p) for p in prompts if isinstance(p, str)} == {32}
    assert len({p.text if isinstance(p, Prompt) else p for p in prompts}) == 16  # all unique
    assert sum(loadgen.is_long(i, 0.1) for i in range(100)) == 10 and not any(loadgen.is_long(i, 0) for i in range(9))
    # without a mix, plain prompts of the workload's length, less the chat template's tokens when given
    plain = loadgen.synthetic_prompts(maker, 4, loadgen.Workload(input_len=32), overhead=5)
    assert all(isinstance(p, str) and maker.count(p) == 27 for p in plain)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"bench_long_share": 0.2}, "needs both bench_long_input_len"),
        ({"bench_long_input_len": 4000, "bench_long_share": 0.2}, "bench_long_input_len 4000 + bench_output_len 128"),
        (
            {"bench_long_input_len": 2000, "bench_long_share": 0.2, "bench_turns": 3, "bench_endpoint": "chat"},
            "a dataset or multi-turn chat",
        ),
    ],
)
def test_a_long_context_mix_that_cannot_run_is_refused_by_name(values, needle):
    with pytest.raises(ParamsError) as err:
        params.validate({"model": "builtin:tiny-qwen3-moe", **values})
    assert needle in str(err.value)
