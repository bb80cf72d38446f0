"""The docs' "write your own freezer" example runs as written.

The python block of docs/extending.md that registers 'int4_packed' is
found by that registration (not by a heading) and run with the freezer
registry restored afterwards.
"""

import pathlib
import re

from aqtr import freezers

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / 'docs' / 'extending.md'
MARK = "@aqtr.freezers.register('int4_packed')"


def _block() -> str:
  text = PAGE.read_text()
  found = [
    b
    for b in re.findall(r'^```python\n(.*?)^```', text, re.S | re.M)
    if MARK in b
  ]
  assert len(found) == 1, f'{PAGE.name}: {len(found)} blocks hold {MARK}'
  return found[0]


def test_write_your_own_freezer_runs(monkeypatch):
  reg = freezers.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  namespace = {'__name__': 'docs_freezer'}
  exec(compile(_block(), 'docs/extending.md freezer', 'exec'), namespace)
  assert freezers.get('int4_packed') is namespace['Int4Packed']
