"""The notebooks under notebooks/ execute top to bottom without an error (outputs are not committed).

Each runs in a fresh ``python3`` kernel of the interpreter running the tests, with an environment without the
test suite's XLA_FLAGS: the notebook's first cell forces its own 8 virtual CPU devices, as a user's would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import PACKAGE_HOME

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 120  # per cell


def test_the_notebooks_are_found() -> None:
    names = [path.name for path in NOTEBOOKS]
    for name in ("01_dispatch_combine_walkthrough", "02_train_moe_layer_cpu", "03_running_on_gpus",
                 "04_two_axis_mesh"):
        assert f"{name}.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_and_has_no_committed_outputs(path: Path, tmp_path: Path, monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (the notebooks need a python3 kernel)")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the notebooks plot)")
    pytest.importorskip("optax", reason="optax is not installed (notebook 02 trains with it)")

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: commit the notebook cleared"

    # A "python3" kernel spec for this interpreter, found first on JUPYTER_PATH (a spec installed elsewhere may
    # point to another Python).
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel inherits this process's environment
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(PACKAGE_HOME))

    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT_S,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if out.output_type == "error"]
    assert not errors, errors
