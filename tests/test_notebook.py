"""results/analysis.ipynb runs in a real python3 kernel: on the committed results (every figure drawn) and
on an empty results folder (every section says "no rows"). The committed copy carries its outputs."""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "results" / "analysis.ipynb"
SECTIONS = ["best-lanes", "relative-speed", "h100-vs-gb10", "parity", "convergence", "smem"]  # code cell ids


def _execute(cwd: Path) -> dict[str, list]:
    """Executes a fresh copy of the notebook (outputs cleared) with ``cwd`` as the kernel's working folder;
    returns each code cell's outputs by cell id. A cell that raises fails the test (CellExecutionError)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    outs = {c.id: c.outputs for c in nb.cells if c.cell_type == "code"}
    assert not [o for cell in outs.values() for o in cell if o.output_type == "error"]
    return outs


def _pngs(outputs: list) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _text(outputs: list) -> str:
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def test_notebook_runs_on_the_committed_results(monkeypatch):
    from lab import analysis, registry
    from lab.results import load
    monkeypatch.delenv("LAB_RESULTS", raising=False)
    outs = _execute(ROOT / "results")  # where Jupyter starts a kernel for this notebook
    df = registry.registered_rows(load(ROOT / "results"))
    groups = analysis.convergence(df).groupby(["requested_profile", "emulated", "actual_gpu", "kernel"]).ngroups
    assert f"{len(df)} rows" in _text(outs["setup"])
    assert {s: _pngs(outs[s]) for s in SECTIONS} == {
        "best-lanes": 0, "relative-speed": 1, "h100-vs-gb10": 1, "parity": 1, "convergence": groups, "smem": 1}
    assert groups >= 2 and any("text/html" in o.get("data", {}) for o in outs["best-lanes"])
    assert "no rows" not in "".join(_text(outs[s]) for s in SECTIONS)
    committed = nbformat.read(NOTEBOOK, as_version=4)  # committed executed, so a reader sees the plots
    assert sum(_pngs(c.outputs) for c in committed.cells if c.cell_type == "code") == sum(_pngs(o) for o in outs.values())


def test_notebook_copes_with_an_empty_results_folder(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "empty"))
    outs = _execute(ROOT)  # from the repository root this time
    assert "0 rows" in _text(outs["setup"])
    for s in SECTIONS:
        assert "no rows" in _text(outs[s]) and _pngs(outs[s]) == 0
