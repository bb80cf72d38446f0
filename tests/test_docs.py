"""Docstring examples and README code blocks run and give what they say."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import aqtr

ROOT = pathlib.Path(__file__).resolve().parents[1]
_OPTIONAL = ('aqtr.flax', 'aqtr.gin')


def _modules():
  for m in pkgutil.walk_packages(aqtr.__path__, 'aqtr.'):
    if not m.name.startswith(_OPTIONAL):
      yield m.name


@pytest.mark.parametrize('name', sorted(_modules()))
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.failed == 0, f'{result.failed} doctest(s) failed in {name}'


def test_readme_python_blocks_run():
  text = (ROOT / 'README.md').read_text()
  blocks = re.findall(r'```python\n(.*?)```', text, re.S)
  assert blocks, 'README has no python blocks'
  for i, block in enumerate(blocks):
    namespace = {'__name__': f'readme_block_{i}'}
    exec(compile(block, f'README.md block {i}', 'exec'), namespace)
