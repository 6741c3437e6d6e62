"""Issue #41 point 4: in a notebook, servebook's error is one line on top (its message and fix), its traceback
folded below; the cell still fails, so papermill and nbval stop there."""

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def run(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    client = NotebookClient(nb, timeout=120, kernel_name="python3")
    with pytest.raises(CellExecutionError):
        client.execute()
    return nb


def test_a_servebook_error_is_its_message_with_the_traceback_folded():
    nb = run(
        "from servebook import ui\n"
        "from servebook.params import Params\n"
        "p = ui.notebook_params({'model': 'builtin:tiny-qwen3-moe', 'port': 80000})"
    )
    outputs = nb.cells[0].outputs
    error = next(o for o in outputs if o.output_type == "error")
    assert error.ename == "ParamsError"
    assert error.traceback[0].startswith("ParamsError: ") and "port" in error.traceback[0]
    assert not any("File " in line for line in error.traceback)  # no red wall of servebook's frames
    kinds = [o.output_type for o in outputs]
    assert kinds.index("error") < kinds.index("display_data")  # the message on top, then the frames folded
    shown = "".join(o.get("data", {}).get("text/html", "") for o in outputs if o.output_type == "display_data")
    assert shown.startswith("<details>") and "Traceback (most recent call last)" in shown


def test_other_errors_keep_their_full_traceback():
    nb = run("from servebook import ui\nui.errors_as_one_line()", "def f():\n    return 1 / 0\nf()")
    error = next(o for o in nb.cells[1].outputs if o.output_type == "error")
    assert error.ename == "ZeroDivisionError" and len(error.traceback) > 1


def test_tables_show_no_column_of_row_numbers_once_a_notebook_has_its_params():
    """Issue #41 point 9: pandas' 0, 1, 2 … column read as data in the report; an index that names rows stays."""
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import pandas as pd\nfrom servebook import ui\n"
            "p = ui.notebook_params({'model': 'builtin:tiny-qwen3-moe', 'interactive': False})"
        ),
        nbformat.v4.new_code_cell("pd.DataFrame({'layout': ['TP=1', 'TP=2'], 'KV tokens': [10, 20]})"),
        nbformat.v4.new_code_cell(
            "pd.DataFrame({'KV tokens': [10, 20]}, index=pd.Index(['TP=1', 'TP=2'], name='layout'))"
        ),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    numbered, named = (c.outputs[0].data["text/html"] for c in nb.cells[1:])
    assert "<th>layout</th>" in numbered and "<th>0</th>" not in numbered and "<th>1</th>" not in numbered
    assert "<th>TP=1</th>" in named  # the index of its own, as row headers
