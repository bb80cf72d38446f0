"""The README's "Write your own freezer" section runs as written.

Its python block is taken from README.md and run with the freezer registry
restored afterwards.
"""

import pathlib
import re

import pytest

from aqtr import freezers

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADING = '## Write your own freezer'


def _section() -> str:
  text = (ROOT / 'README.md').read_text()
  if HEADING not in text:
    pytest.fail(f'no {HEADING!r} section in README.md.')
  section = text.split(HEADING, 1)[1]
  return re.split(r'\n## ', section, maxsplit=1)[0]


def test_write_your_own_freezer_runs(monkeypatch):
  blocks = re.findall(r'```python\n(.*?)```', _section(), re.S)
  assert len(blocks) == 1
  reg = freezers.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  namespace = {'__name__': 'readme_freezer'}
  exec(compile(blocks[0], 'Write your own freezer', 'exec'), namespace)
  assert freezers.get('int4_packed') is namespace['Int4Packed']
