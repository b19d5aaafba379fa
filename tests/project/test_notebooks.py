"""The walkthrough notebooks run end to end (01-04) and the GPU notebook (05) is valid and stripped.

Design: each runnable notebook is copied into ``tmp_path`` and executed there with nbclient, so whatever it writes
(``runs/...``) stays in the temporary directory. The kernel is a temporary ``python3`` kernel spec written into
``tmp_path`` that points at ``sys.executable`` and is put first on ``JUPYTER_PATH``: the notebooks then run in this
interpreter (the project's venv) on a fresh clone, without installing a kernel spec for the user. Every notebook
holds assert cells on the library's results, so a broken API fails here as a cell error.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("jupyter_client.kernelspec")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
RUNNABLE = ["01_quickstart", "02_locating_heads", "03_patching_and_ablation", "04_probes_and_rsa",
            "06_your_experiment"]
GPU_ONLY = "05_real_checkpoint_gpu"
TIMEOUT_S = 300  # per cell; each notebook takes well under a minute on 2 cores


@pytest.fixture
def python3_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``python3`` kernel spec for this interpreter, found first through ``JUPYTER_PATH``."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    kernel = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (vlmbind tests)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # keep the kernel from claiming every core on a shared machine
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    found = kernelspec.KernelSpecManager().get_kernel_spec("python3")
    assert Path(found.argv[0]) == Path(sys.executable), "the temporary kernel spec must win over any installed one"
    return "python3"


@pytest.mark.parametrize("name", RUNNABLE)
def test_notebook_runs(name: str, tmp_path: Path, python3_kernel: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    path = shutil.copy(NOTEBOOKS / f"{name}.ipynb", work / f"{name}.ipynb")
    nb = nbformat.read(path, as_version=4)
    n_asserts = sum("assert" in c.source for c in nb.cells if c.cell_type == "code")
    assert n_asserts >= 1, f"{name} needs at least one check cell"
    client = nbclient.NotebookClient(nb, kernel_name=python3_kernel, timeout=TIMEOUT_S,
                                     resources={"metadata": {"path": str(work)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell (asserts included)
    seconds = time.perf_counter() - start
    print(f"{name}: {seconds:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
    # outputs stay in the temporary copy: the committed notebook is untouched and stripped
    assert not any(c.get("outputs") for c in nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
                   if c.cell_type == "code")


@pytest.mark.parametrize("name", [*RUNNABLE, GPU_ONLY])
def test_notebook_is_valid_and_stripped(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and any(c.cell_type == "markdown" for c in nb.cells)
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_gpu_notebook_targets_the_real_checkpoint() -> None:
    cells = nbformat.read(NOTEBOOKS / f"{GPU_ONLY}.ipynb", as_version=4).cells
    source = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert 'vb.load("Qwen/Qwen2.5-VL-7B-Instruct", torch_dtype=torch.bfloat16, device_map="auto")' in source
    for call in ("vb.locate(", "vb.ablation_study(", "vb.capture(", "probe_sites(", "track("):
        assert call in source, call
    compile(source, GPU_ONLY, "exec")  # at least syntactically valid Python


def test_the_your_experiment_notebook_is_the_pages_code() -> None:
    """notebooks/06_your_experiment.ipynb runs exactly the Python blocks of docs/your_experiment.md, in order (the
    page's shown results are asserted by tests/project/test_docs.py)."""
    import re

    page = (NOTEBOOKS.parent / "docs" / "your_experiment.md").read_text()
    blocks = [b.rstrip("\n") for b in re.findall(r"```python\n(.*?)```", page, flags=re.S)]
    cells = [c.source for c in nbformat.read(NOTEBOOKS / "06_your_experiment.ipynb", as_version=4).cells
             if c.cell_type == "code"]
    assert cells == blocks
