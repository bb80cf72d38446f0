"""Docstring examples and README code blocks run and give what they say."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import aqtr

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Modules of optional extras: {package prefix: the module the extra adds}.
_OPTIONAL = {
  'aqtr.checkpoints': 'flax',
  'aqtr.flax': 'flax',
  'aqtr.gin': 'gin',
  'aqtr.lora': 'flax',
  'aqtr.pax': 'flax',
}


def _modules():
  for m in pkgutil.walk_packages(aqtr.__path__, 'aqtr.'):
    yield m.name


@pytest.mark.parametrize('name', sorted(_modules()))
def test_docstring_examples(name):
  for prefix, extra in _OPTIONAL.items():
    if name.startswith(prefix):
      pytest.importorskip(extra)
  module = importlib.import_module(name)
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.failed == 0, f'{result.failed} doctest(s) failed in {name}'


def test_readme_python_blocks_run(monkeypatch):
  # The README registers example algorithms; keep them out of the registries
  # the other tests see.
  for family in ('calibrations', 'numerics', 'tilings', 'freezers'):
    reg = getattr(aqtr, family).registry
    monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  text = (ROOT / 'README.md').read_text()
  blocks = re.findall(r'```python\n(.*?)```', text, re.S)
  assert blocks, 'README has no python blocks'
  for i, block in enumerate(blocks):
    namespace = {'__name__': f'readme_block_{i}'}
    exec(compile(block, f'README.md block {i}', 'exec'), namespace)
