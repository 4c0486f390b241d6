"""The notebooks run top to bottom on the embedded model (as CI does)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["quickstart.ipynb", "credit_heatmaps.ipynb"])
def test_notebook_runs(name, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(Path("notebooks") / name, as_version=4)
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the heatmap was displayed
