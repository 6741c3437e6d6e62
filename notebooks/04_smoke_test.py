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
# # 04 · Smoke test
#
# **Answers:** does the server answer, correctly and deterministically, and how fast is one stream. **Needs:** the server stage 03 started, still running.
#
# - `/v1/models` must list the served name;
# - a chat completion and a plain completion at temperature 0, each sent twice, must return identical
#   answers with generated tokens, a finish reason and usage counts (the text may be blank: vLLM drops special
#   tokens and partial characters from it, and a random-weight checkpoint may emit little else);
# - one streamed request (exactly `smoke_max_tokens` tokens) measures the time to first token and the
#   single-stream decode speed, (completion tokens − 1) / (last chunk − first chunk);
# - `/metrics` is read and the key gauges shown.
#
# The server's address comes from `03_launch.json`, never from the launch notebook's variables.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
smoke_max_tokens: int = 32  # tokens per smoke-test answer (the streamed one is forced to exactly this)
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from IPython.display import display

from servebook import ui
from servebook.stages import smoke_test as stage

p = ui.notebook_params(globals())
smoke = stage.run(p, run_dir)
display(stage.checks_table(smoke))

# %% [markdown]
# ## Answers

# %%
for label, answer in (("chat", smoke.chat), ("completion", smoke.completion)):
    print(f"{label + ':':12}", repr(answer.text[:200]), answer.finish_reason, answer.usage)

# %% [markdown]
# ## One stream

# %%
print(stage.stream_text(smoke.stream))

# %% [markdown]
# ## Server gauges

# %%
display(stage.gauges_table(smoke))

# %%
stage.check(smoke, p)
