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
# # 02 · Download
#
# **Answers:** is the checkpoint on local disk, complete and verified. **Needs:** the Hub (`HF_TOKEN` in the environment for gated repos) or a local folder.
#
# Get the checkpoint onto local disk, and know it arrived intact, before a 36-minute load finds out otherwise.
#
# 1. **Preflight**: the exact files to fetch (after `download_allow` / `download_ignore`) and their sizes come
#    from the hub's metadata, and are weighed against the free space under `model_store` with a margin. If they do
#    not fit, the stage stops with both numbers before a byte is fetched. Files already complete are skipped.
# 2. **Fetch** through huggingface_hub (hf_xet or hf_transfer when installed), `download_workers` files at a time,
#    pinned to the commit the revision resolved to. Progress (bytes, rate, time left) is a bar in JupyterLab and a
#    line every few seconds in batch runs. An interrupted download resumes where it stopped.
# 3. **Verify** every file: size, SHA-256 for LFS files or the git blob id otherwise, safetensors headers against
#    their data and the index, `config.json` and a tokenizer present. A bad file is named with the fix.
# 4. **Warm the page cache** (`page_cache_warmup`) when RAM holds the checkpoint with room to spare, so the first
#    start reads memory, not the disk. Skipped for `load_format` fastsafetensors or instanttensor: they read with
#    O_DIRECT, past the page cache.
#
# The token comes only from `HF_TOKEN` in the environment. For the embedded default the stage builds (or reuses)
# the tiny checkpoint and verifies it against the checksums recorded when it was built.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
model_store: str = "~/.cache/huggingface"  # where checkpoints live; its free space is checked
download_revision: str = "main"  # branch, tag or commit to fetch
download_allow: list[str] = []  # only files matching these globs; empty means all
download_ignore: list[str] = []  # skip files matching these globs
download_workers: int = 8  # files fetched in parallel
download_disk_margin: float = 0.05  # free space required beyond the download, as a share
page_cache_warmup: bool = True  # read the checkpoint into the page cache after download, if RAM allows
load_format: str = "auto"  # --load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from IPython.display import Markdown, display

from servebook import ui
from servebook.stages import download as stage

p = ui.notebook_params(globals())
got = stage.run(p, run_dir)

# %% [markdown]
# ## What arrived

# %%
f, v = got.fetch, got.verification
lines = [f"**{got.model}** → `{got.local_path}` ({got.bytes / 1e9:,.3f} GB)"]
if got.commit:
    lines.append(f"- revision `{got.revision}` resolved to commit `{got.commit}`")
if f:
    rate = f"{f.rate_bytes_s / 1e6:,.1f} MB/s" if f.rate_bytes_s else "n/a"
    lines.append(f"- fetched {len(f.fetched_files)} files ({f.bytes_fetched / 1e9:,.3f} GB) in {f.seconds:.1f} s at {rate}; "
                 f"{len(f.skipped_files)} already complete")
per_gb = f", {v.seconds_per_gb:.1f} s per GB" if v.seconds_per_gb else ""
lines.append(f"- verification: {'**passed**' if v.ok else '**failed**'} in {v.seconds:.2f} s{per_gb}")
lines += [f"  - ❌ {problem}" for problem in v.problems]
display(Markdown("\n".join(lines)))
display(stage.file_table(got))

# %%
stage.check(got, p)
