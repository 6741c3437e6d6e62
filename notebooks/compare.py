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
# # Compare runs
#
# **Answers:** which of several benchmarked configurations serves more, at which concurrency one overtakes
# another, and whether their workloads can be compared at all. **Needs:** two or more run folders with a
# `05_benchmark.json` (from `servebook run` or the notebooks) or `vllm bench serve --save-result` files.
#
# The runs share axes: output tokens per second, per-user speed and TTFT p50 against concurrent streams, one
# colour per run in every panel. A crossover is the concurrency from which the second run's throughput stays
# above the first's. Runs measured with different prompt or output lengths are flagged, since their throughputs
# are not the same quantity. `servebook compare RUN_A RUN_B` draws the same figure from a terminal.

# %% tags=["parameters"]
runs: list[str] = []  # run folders or `vllm bench serve` result files; in JupyterLab, the picker below sets them
search_dirs: list[str] = ["../outputs", "../docs/examples"]  # where the picker looks for runs
interactive: bool = True  # the picker (JupyterLab); headless runs compare `runs` as given

# %%
from IPython.display import Markdown, display

from servebook import workbook

if interactive:
    display(workbook.run_picker(globals(), search_dirs))
else:
    print(f"{len(runs)} runs: {', '.join(runs) or '(none)'}")

# %% [markdown]
# ## The runs on shared axes

# %%
comparison = workbook.compare_runs(runs)
if comparison.figure:
    comparison.figure.show()
display(Markdown(comparison.text()))
