# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-all
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: servebook (.venv)
#     language: python
#     name: servebook
# ---

# %% [markdown]
# # 05 · Benchmark
#
# **Answers:** throughput and latency from one stream to saturation, and what limits each level. **Needs:** the server stage 03 started, still running.
#
# Throughput and latency from one stream to saturation: the "try a larger batch" step, made automatic.
# Concurrency doubles from 1 until output throughput gains less than `bench_plateau_gain` over two
# doublings (a plateau), a latency objective breaks, or `bench_max_concurrency` is reached. The record says
# which: only the first is called a plateau; reaching the limit while throughput still rises is "not saturated".
# A plateau whose gains lie inside the levels' own repeat spread is not one: the sweep goes on to the next level.
#
# What makes the numbers trustworthy:
# - every prompt is exactly `bench_input_len` tokens of the served model's tokenizer and unique, so no
#   level reuses another's prefix cache (the cache is also reset between levels where the server allows it);
# - every answer is exactly `bench_output_len` tokens (`ignore_eos`, `min_tokens`, `max_tokens`), checked
#   against the server's usage counts;
# - each level first sends as many warm-up requests as its concurrency, then measures a window of at least
#   `bench_prompts_per_level` requests (4 per stream) and `bench_min_level_s` seconds, `bench_repeats` times;
#   while the repeats spread wider than `bench_max_spread_pct` it measures again, up to `bench_max_repeats`
#   runs, and the tables show the spread that remains (a few seconds of a fast GPU server are not a
#   measurement: two 5-second repeats at 16 streams once differed by 72 %);
# - a level that falls below the best in every repeat ends the sweep as a decline: past saturation;
# - the client is an asyncio process with an unthrottled connection pool and a 16 MB read buffer that times
#   token chunks without parsing them; once one passes half a core the next levels share the streams among
#   twice as many processes (`bench_client_processes` fixes the number), and its CPU is in every level's row;
#   time a request waits for a free slot is reported as *client queue*, not hidden in TTFT.
#
# Metric definitions (vLLM's names) are in `servebook.metrics`: TTFT, TPOT = (E2EL − TTFT)/(output − 1),
# ITL per chunk and per token, E2EL, output/total/request throughput, goodput.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
bench_input_len: int = 128  # prompt tokens per request
bench_output_len: int = 128  # output tokens per request (ignore_eos)
bench_endpoint: str = "completions"  # completions or chat
bench_shared_prefix_len: int = 0  # tokens every prompt shares; 0 means all unique
bench_long_input_len: int = 0  # prompt tokens of the long-context requests mixed in (bench_long_share); 0 means none
bench_long_share: float = 0.0  # share of requests carrying bench_long_input_len prompt tokens, spread evenly
bench_max_concurrency: int = 256  # highest concurrency the sweep may reach
bench_repeats: int = 2  # runs per concurrency level, for the spread
bench_prompts_per_level: int = 64  # measured requests per repeat (at least 4x concurrency)
bench_min_level_s: float = 20.0  # each repeat's window (and each A/B point's) lasts at least this many seconds
bench_max_spread_pct: float = 10.0  # repeat a level while its runs spread wider than this (% of the median)
bench_max_repeats: int = 4  # most runs per level when the spread stays wide
bench_plateau_gain: float = 0.05  # stop when two doublings gain less than this share
bench_ttft_slo_ms: float = 0.0  # TTFT objective in ms; 0 means none
bench_tpot_slo_ms: float = 0.0  # TPOT objective in ms; 0 means none
bench_e2el_slo_ms: float = 0.0  # end-to-end latency objective in ms; 0 means none
bench_request_timeout_s: float = 600.0  # a request without a complete answer by then counts as failed
bench_client_processes: int = 0  # client processes sharing the streams; 0 doubles them past half a core each
bench_turns: int = 1  # over 1: multi-turn chat, each conversation sending its history back (chat only)
bench_dataset: str = ""  # ShareGPT JSON or JSONL file of requests with their own lengths; empty means synthetic
bench_dataset_format: str = "auto"  # the dataset's layout: auto (a JSON list is ShareGPT), sharegpt or jsonl
bench_request_rates: list[float] = []  # requests/s of the open-loop sweep after the concurrency sweep, lowest first; empty means none
bench_arrival: str = "poisson"  # how open-loop requests arrive: poisson, gamma (with bench_burstiness) or constant
bench_burstiness: float = 1.0  # gamma arrivals' shape, as vllm bench serve's: under 1 burstier, over 1 more even
bench_rate_requests: int = 32  # measured requests per rate (and bench_min_level_s)
bench_goodput_target_pct: float = 90.0  # a rate meets the objectives when this share of its requests meets all
max_model_len: int = 4096  # longest request (prompt + output) in tokens
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
import pandas as pd
from IPython.display import Markdown, display

from servebook import live, plots, ui, workbook
from servebook.stages import benchmark as stage

p = ui.notebook_params(globals())
if p.interactive:
    display(workbook.sweep_controls(globals()))
else:
    print(workbook.sweep_estimate(p))

# %% [markdown]
# ## The sweep
# In JupyterLab the chart gains a point as each level is measured, and the panel under it shows the GPUs'
# memory, utilisation, power and clocks (NVML; on the CPU default, the host's CPU and memory) every second.
# Interrupting the cell stops both and keeps every level measured so far in `05_benchmark.json`.

# %%
with live.resource_panel(p.interactive, stage.gpus_of(run_dir)):
    result = stage.run(p, run_dir, on_level=live.live_sweep(p.interactive))

# %% [markdown]
# ## Summary

# %%
display(Markdown("\n".join(stage.summary_lines(result, p))))
if not result.levels:
    stage.check(result, p)  # nothing was measured: the fault above is the answer, and the stage fails with it

# %% [markdown]
# ## Per level (median of repeats; latencies in ms)

# %%
levels = stage.levels(result)
cols = ["concurrency", "output_throughput", "spread_pct", "per_user_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
        "tpot_p99_ms", "e2el_p50_ms", "client_queue_p50_ms", "kv_cache_usage_peak", "waiting_peak", "preemptions", "prefix_cache_hit_rate", "failed",
        "client clock"]
display(levels[[c for c in cols if c in levels]].round(2))

# %% [markdown]
# ## The client's clock against vLLM's
#
# vLLM times every request itself and publishes the result as histograms on `/metrics`; read before and after
# each window, they give the engine's own mean TTFT (from when its engine client took the request in, after the
# API server parsed it, to when the API process handled the first token) and mean TPOT (the engine core's time
# from the first token to the last, per token after the first), over the same requests the client timed
# (`vllm/v1/metrics/stats.py`). The client's TTFT is always longer, by the HTTP request and the stream's first
# write; its TPOT should match the engine's. A TPOT more than 25 % off means the tokens reached the client late
# or in bursts: the API server fell behind the engine, and the latencies of that level describe the delivery,
# not the engine. Where the two request counts differ, something else used the server during the window.

# %%
clocks = stage.clock_table(levels)
display(clocks if not clocks.empty else Markdown("The server's `/metrics` gave no latency histograms."))

# %% [markdown]
# ## What limits each level
#
# From what was gathered during the level: the load generator's own CPU time (it must never silently be the
# limit), vLLM's running and waiting requests against `max_num_seqs` (sampled) and the mean time requests spent
# in its queue (its own histogram, which no sampling gap can miss), KV-cache usage and preemptions, whether the
# API server kept pace with the engine (the clocks above), on GPUs
# what NVML saw (SM utilisation, power against its limit, clock slowdowns, PCIe traffic against the link), and
# the gain over the level before. A CPU server has no GPU evidence, and the line under the table says so. Beside
# them, the plan's decode ceiling for this layout at this many streams (weights, touched experts and the KV
# this workload's streams hold, read once per step at the GPU's memory bandwidth) and the measured throughput as
# a share of it.

# %%
limits, limits_note = stage.limits_table(levels)
display(stage.limits_style(limits))
if limits_note:
    print(limits_note)

# %% [markdown]
# ## Explore the levels
# In JupyterLab: pick a metric and a level; the curve marks the level and the row beside it says what limited
# it. Headless runs have the tables above and the plots below.

# %%
if p.interactive and result.levels:
    display(workbook.level_explorer(levels, limits))

# %% [markdown]
# ## Replicas behind the router
# With `replicas` above 1 the benchmark's requests went through vllm-router; each replica's share of the finished
# requests and its prefix-cache hit rate come from its own `/metrics`, so an unbalanced router, or a policy that
# sends a conversation away from its cached prefix, shows here. One server: nothing to show.

# %%
shares = stage.replica_table(result.levels)
display(shares if not shares.empty else Markdown("One server, no router: no replica shares."))

# %% [markdown]
# ## Plots

# %%
if result.levels:
    plots.throughput(result).show()
    plots.pareto(result).show()
    plots.latency(result).show()

# %% [markdown]
# ## Open-loop request rates
#
# Users do not wait for each other: with `bench_request_rates` set, requests then arrive on their own schedule
# (`bench_arrival`: a Poisson process, gamma gaps with `bench_burstiness` as `vllm bench serve` draws them, or
# evenly spaced), each rate for at least `bench_rate_requests` requests and `bench_min_level_s` seconds. A
# server keeps up while it completes what is offered; the first rate it cannot keep up with (under 90 %) or that
# breaks the latency objectives (fewer than `bench_goodput_target_pct` % of requests meeting them) ends the
# sweep. That is a finding about the server, not a failure of the run. "TPOT, client against vLLM" compares the
# client's mean TPOT with vLLM's own clock, as in the closed-loop table above.

# %%
if result.rates:
    rates = pd.DataFrame([level.model_dump() for level in result.rates.levels])
    best_rate = f"**{result.rates.best_rate:g} requests/s**" if result.rates.best_rate else "none"
    display(Markdown(f"- highest rate kept up with{' within the objectives' if result.rates.objectives else ''}: "
                     f"{best_rate}\n- stopped: {result.rates.stop_reason}"))
    display(stage.rates_style(rates))
    plots.rates(result.rates).show()
else:
    display(Markdown("No open-loop sweep: `bench_request_rates` is empty."))

# %%
stage.check(result, p)
