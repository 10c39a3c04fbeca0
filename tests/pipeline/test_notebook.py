"""notebooks/inspect_samples.ipynb runs top to bottom in a real Jupyter kernel on a run made by the tests."""

import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "inspect_samples.ipynb"


def execute(nb, monkeypatch, run_dir: Path | None = None):
    # The kernel is a fresh process: it must import this checkout and read the run named by the environment.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    if run_dir is not None:
        monkeypatch.setenv("ASYNCRL_RUN_DIR", str(run_dir))
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code")


def test_kernel_is_this_venv_and_checkout(monkeypatch):
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("import sys, pipeline\nprint(sys.prefix)\nprint(pipeline.__file__)")]
    )
    (out,) = execute(nb, monkeypatch)
    prefix, module = out.text.split()
    assert prefix == sys.prefix
    assert Path(module).parent == ROOT / "pipeline"


@pytest.mark.slow
def test_notebook_on_a_partial_rollout_run(partial_run, monkeypatch):
    _, run_dir = partial_run
    outputs = execute(nbformat.read(NOTEBOOK, as_version=4), monkeypatch, run_dir)  # raises if a cell fails
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"run: {run_dir}" in text
    assert int(re.search(r"partial samples: (\d+)", text).group(1)) > 0
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) == 4  # reward, staleness, partial responses, lengths
