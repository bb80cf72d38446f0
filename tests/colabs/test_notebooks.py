"""colabs/: every notebook runs top to bottom; outputs are stripped in git.

The default suite runs each notebook at toy size (AQTR_COLAB_SMALL=1)
but the three longest (LONG below: 118 to 148 s each at toy size on a
loaded host, 55 % of the notebooks' time), whose features the default
suite runs elsewhere (the catalogue on stock models:
tests/flax/test_catalogue_contract.py; LoRA / QLoRA: docs/lora.md's blocks
and tests/lora/; the PTQ solvers: docs/ptq.md's blocks, tests/ptq/ and
tests/papers/test_ptq_solvers.py), and the docs build runs (.ci/run's
second command: docs/conf.py executes a notebook at toy size when this
test left no executed copy). `pytest -m slow` runs those three at toy
size and every notebook at full size. A notebook's kernel gets the
repository root on PYTHONPATH and one CPU device. The toy-size run leaves
its executed copy in docs/_build/executed/ (not in git), which the docs
build renders with its outputs.
"""

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COLABS = ROOT / 'colabs'
EXECUTED = ROOT / 'docs' / '_build' / 'executed'
NOTEBOOKS = sorted(COLABS.glob('*.ipynb'))
IDS = [p.stem for p in NOTEBOOKS]
LONG = ('catalogue_on_a_stock_model', 'lora_qlora', 'ptq_solvers')
SMALL = [
  pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in LONG else [])
  for p in NOTEBOOKS
]


def _execute(path: pathlib.Path, small: bool, timeout: int) -> None:
  nbformat = pytest.importorskip('nbformat')
  nbclient = pytest.importorskip('nbclient')
  pytest.importorskip('ipykernel')
  book = nbformat.read(path, as_version=4)
  env = {
    'AQTR_COLAB_SMALL': '1' if small else '0',
    'XLA_FLAGS': os.environ.get('AQTR_TEST_XLA_FLAGS', ''),
    'PYTHONPATH': os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])]
    ),
  }
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)  # The kernel inherits this process's environment.
  try:
    client = nbclient.NotebookClient(
      book,
      timeout=timeout,
      kernel_name='python3',
      resources={'metadata': {'path': str(COLABS)}},
    )
    client.execute()
    if small:  # for the docs site (docs/conf.py renders it)
      EXECUTED.mkdir(parents=True, exist_ok=True)
      nbformat.write(book, EXECUTED / path.name)
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def test_there_are_notebooks_and_the_readme_lists_them():
  assert len(NOTEBOOKS) >= 5
  readme = (COLABS / 'README.md').read_text()
  for p in NOTEBOOKS:
    assert p.name in readme, f'colabs/README.md does not list {p.name}'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=IDS)
def test_outputs_are_stripped(path):
  nbformat = pytest.importorskip('nbformat')
  nbformat.validate(nbformat.read(path, as_version=4))
  book = json.loads(path.read_text())
  for i, cell in enumerate(book['cells']):
    where = f'{path.name} cell {i}: strip outputs (clear all outputs)'
    if cell['cell_type'] == 'code':
      assert cell['outputs'] == [], where
      assert cell['execution_count'] is None, where
    assert set(cell['metadata']) <= {'id', 'colab'}, where
  assert set(book['metadata']) <= {'kernelspec', 'language_info', 'colab'}


@pytest.mark.parametrize('path', NOTEBOOKS, ids=IDS)
def test_first_cell_installs_aqtr_only_when_missing(path):
  book = json.loads(path.read_text())
  code = [c for c in book['cells'] if c['cell_type'] == 'code']
  first = ''.join(code[0]['source'])
  assert 'import aqtr' in first and 'except ImportError' in first
  assert 'pip' in first and 'AQTR_COLAB_SMALL' in first


def test_long_notebooks_exist():
  assert set(LONG) <= set(IDS)


@pytest.mark.parametrize('path', SMALL)
def test_runs_at_small_size(path):
  _execute(path, small=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize('path', NOTEBOOKS, ids=IDS)
def test_runs_at_full_size(path):
  _execute(path, small=False, timeout=900)
