# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,language_info,jupytext,-all
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   language_info:
#     codemirror_mode:
#       name: ipython
#       version: 3
#     file_extension: .py
#     mimetype: text/x-python
#     name: python
#     nbconvert_exporter: python
#     pygments_lexer: ipython3
#     version: 3.11.7
# ---

# %% [markdown]
# # 04 · Smoke test
#
# Does the server launched in stage 03 answer, correctly and deterministically, and how fast is one stream?
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
smoke_max_tokens: int = 32  # tokens per smoke-test answer (the streamed one is forced to exactly this)
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
import pandas as pd
from IPython.display import display

from servebook import params
from servebook.stages import smoke_test as stage

p = params.from_namespace(globals())
smoke = stage.run(p, run_dir)
display(pd.DataFrame([c.model_dump() for c in smoke.checks]))

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
display(pd.Series(smoke.metrics, name="value").to_frame())

# %%
stage.check(smoke, p)
