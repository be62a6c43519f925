"""The Colab notebooks run top to bottom on a CPU with their smoke settings (``JKV_NOTEBOOK_SMOKE=1``).

Each runs in a fresh kernel in a temporary directory, so whatever it writes stays out of the tree, all of them at
once; any cell that raises fails its notebook's test with the cell and its error. The notebooks in the repository
carry no outputs.
"""

import asyncio
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLAB = pathlib.Path(__file__).resolve().parents[1] / "colab"
# gpu_benchmark too: on a CPU its smoke settings run benchmarks/kernel_decode.py --smoke (interpret mode) and the
# XLA-path timing on the default model, which proves the cells run; the executed GPU copy is made on a GPU.
EXECUTED_ON_CPU = ["quickstart", "compare", "your_own_model", "gpu_benchmark"]
ALL = sorted(p.stem for p in COLAB.glob("*.ipynb") if not p.stem.endswith("_executed"))


def _load(name):
  return nbformat.read(COLAB / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_stripped_and_starts_with_badge_and_install(name):
  nb = _load(name)
  nbformat.validate(nb)
  assert "colab-badge.svg" in nb.cells[0].source
  assert "Needs:" in nb.cells[1].source
  install = nb.cells[2]
  assert install.cell_type == "code" and "PLACEHOLDER" in install.source and 'find_spec("jkv")' in install.source
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs are not stripped"


def test_every_notebook_runs_here():
  assert sorted(EXECUTED_ON_CPU) == ALL


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
  """The notebooks this run's test_notebook_runs_on_cpu items ask for, executed all at once, each in a kernel of its
  own, since one notebook, mostly compiling, leaves much of CI's second core idle. Returns {name: (the executed
  notebook, the error its run raised or None)}."""
  names = [item.callspec.params["name"] for item in request.session.items
           if getattr(item, "function", None) is test_notebook_runs_on_cpu]
  notebooks = {name: _load(name) for name in names}
  with pytest.MonkeyPatch.context() as mp:  # what the kernels inherit when they start
    mp.setenv("JKV_NOTEBOOK_SMOKE", "1")
    mp.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Colab: plots become outputs
    mp.setenv("JAX_PLATFORMS", "cpu")
    mp.setenv("JKV_REPO_DIR", str(COLAB.parent))  # where gpu_benchmark finds benchmarks/
    # The kernel must find this interpreter's `jkv` console script (`!jkv compare`) whatever PATH the run has.
    mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    clients = [nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                       resources={"metadata": {"path": str(tmp_path_factory.mktemp(name))}})
               for name, nb in notebooks.items()]

    async def run_all():
      return await asyncio.gather(*(c.async_execute() for c in clients), return_exceptions=True)

    results = asyncio.run(run_all())
  return {name: (nb, r if isinstance(r, BaseException) else None) for (name, nb), r in zip(notebooks.items(), results)}


@pytest.mark.parametrize("name", EXECUTED_ON_CPU)
def test_notebook_runs_on_cpu(name, executed):
  nb, error = executed[name]
  if error is not None:
    raise error  # CellExecutionError names the cell and its error
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} showed no plot"


def test_gpu_benchmark_executed_copy_is_a_run_of_this_notebook():
  """The committed H100 run of gpu_benchmark: the same code cells as the notebook, every one executed, no error,
  the kernel table and the plots in its outputs."""
  executed = nbformat.read(COLAB / "gpu_benchmark_h100_executed.ipynb", as_version=4)
  source = _load("gpu_benchmark")
  code = lambda nb: [c.source for c in nb.cells if c.cell_type == "code"]
  assert code(executed) == code(source)
  cells = [c for c in executed.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in cells)
  outputs = [o for c in cells for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "H100" in text and "| kivi2_fused |" in text.replace("| B | L | kivi2_fused |", "| kivi2_fused |")
  assert any("image/png" in o.get("data", {}) for o in outputs)
