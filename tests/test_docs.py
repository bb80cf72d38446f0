"""Docstring examples and the docs' code blocks run and give what they say.

Every ```python block of README.md and docs/**/*.md is its own test
(id: page and block index). The blocks of one page run in order in one
namespace (a block may use the names of the blocks above it): the
namespace is kept per page in `_PAGES` (emptied after the page's last
block), so each block runs once per process; a block whose page's earlier
blocks have not run in this process runs them first. Registrations a
page makes (an example calibration, freezer, ...) are visible to that
page's later blocks only, never to other tests. A page holding the line
`<!-- docs-test: slow -->` has its blocks marked slow.
"""

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re
import shutil
import subprocess
import sys

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
_FAMILIES = (
  'calibrations',
  'numerics',
  'tilings',
  'freezers',
  'sparsity',
  'transforms',
)
_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)


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


def pages() -> list[pathlib.Path]:
  """README.md and every Markdown page of docs/ (not its build output)."""
  found = sorted(
    p
    for p in (ROOT / 'docs').rglob('*.md')
    if '_build' not in p.relative_to(ROOT / 'docs').parts
  )
  return [ROOT / 'README.md', *found]


def blocks(page: pathlib.Path) -> list[str]:
  """The ```python blocks of one page, in order."""
  return _BLOCK.findall(page.read_text())


# A page whose blocks take long (real checkpoints, long training) holds
# this line; its blocks then run with `pytest -m slow` only.
SLOW_PAGE = '<!-- docs-test: slow -->'


def _cases():
  for page in pages():
    name = page.relative_to(ROOT).as_posix()
    # One xdist worker runs a page's blocks (--dist=loadgroup).
    marks = [pytest.mark.xdist_group(name)]
    if SLOW_PAGE in page.read_text().splitlines():  # a line of its own
      marks.append(pytest.mark.slow)
    for i in range(len(blocks(page))):
      yield pytest.param(name, i, id=f'{name}::{i}', marks=marks)


class _Page:
  """One page's namespace, blocks run so far and registrations made."""

  def __init__(self, name: str):
    module = re.sub(r'\W', '_', name)
    self.namespace = {'__name__': f'docs_{module}'}
    self.done = 0
    self.failed: int | None = None
    self.registered = {f: {} for f in _FAMILIES}


_PAGES: dict[str, _Page] = {}


def _run(page: _Page, name: str, code: str, i: int, monkeypatch) -> None:
  """Runs block i of a page with only that page's registrations visible."""
  regs = {f: getattr(aqtr, f).registry for f in _FAMILIES}
  before = {f: dict(reg._classes) for f, reg in regs.items()}
  for family, reg in regs.items():
    mine = {**before[family], **page.registered[family]}
    monkeypatch.setattr(reg, '_classes', mine)
  try:
    exec(compile(code, f'{name} block {i}', 'exec'), page.namespace)
  finally:
    for family, reg in regs.items():
      for key, cls in reg._classes.items():
        if key not in before[family]:
          page.registered[family][key] = cls


@pytest.mark.parametrize(('name', 'index'), list(_cases()))
def test_doc_block(name, index, monkeypatch):
  code = blocks(ROOT / name)
  page = _PAGES.setdefault(name, _Page(name))
  while page.done < index:  # earlier blocks not run in this process yet
    if page.failed is not None:
      pytest.fail(f'{name}: block {page.failed} failed; this one needs it.')
    try:
      with monkeypatch.context() as m:
        _run(page, name, code[page.done], page.done, m)
    except BaseException:
      page.failed = page.done
      raise
    page.done += 1
  if page.failed is not None:
    pytest.fail(f'{name}: block {page.failed} failed; this one needs it.')
  try:
    _run(page, name, code[index], index, monkeypatch)
  except BaseException:
    page.failed = index
    raise
  page.done = index + 1
  if page.done == len(code):  # the page's last block: free what it built
    page.namespace.clear()


def test_every_page_is_in_a_toctree():
  """Each docs page is reachable from the site's navigation."""
  docs = ROOT / 'docs'
  text = '\n'.join(p.read_text() for p in docs.rglob('*.md'))
  trees = re.findall(r'```\{toctree\}\n(.*?)```', text, re.S)
  listed = set()
  for tree in trees:
    listed |= {e.strip() for e in tree.splitlines() if e and e[0] != ':'}
  for p in docs.rglob('*.md'):
    rel = p.relative_to(docs)
    if rel.parts[0] == '_build' or rel.as_posix() == 'index.md':
      continue
    stem = rel.with_suffix('').as_posix()
    short = rel.with_suffix('').name
    assert stem in listed or short in listed, f'{stem} is in no toctree'


@pytest.mark.parametrize('family', _FAMILIES)
def test_every_registered_class_is_in_the_api_reference(family):
  """docs/api/registries.md documents each family's public names."""
  module = getattr(aqtr, family)
  api = (ROOT / 'docs' / 'api' / 'registries.md').read_text()
  assert f'.. automodule:: aqtr.{family}' in api
  for name in module.names():
    cls = module.get(name)
    if cls.__module__.startswith('aqtr.'):
      assert cls.__name__ in module.__all__, (family, name)
      assert f'aqtr.{family}.{cls.__name__}' in api, (family, name)


def _api_modules():
  for page in sorted((ROOT / 'docs' / 'api').glob('*.md')):
    for module in re.findall(
      r'^\.\. automodule:: (\S+)', page.read_text(), re.M
    ):
      yield pytest.param(page, module, id=f'{page.stem}:{module}')


@pytest.mark.parametrize(('page', 'module'), list(_api_modules()))
def test_api_pages_list_every_public_name(page, module):
  """A name added to a module's __all__ gets its entry in the API page."""
  for prefix, extra in _OPTIONAL.items():
    if module.startswith(prefix):
      pytest.importorskip(extra)
  mod = importlib.import_module(module)
  text = page.read_text()
  for name in getattr(mod, '__all__', ()):
    if inspect.ismodule(getattr(mod, name)):
      continue
    assert f'{module}.{name}\n' in text, (
      f'{page.name} lacks {module}.{name}: add an autoclass / autofunction'
      ' / autodata line and its autosummary entry.'
    )


@pytest.mark.slow
def test_site_builds_with_warnings_as_errors(tmp_path):
  """The README's build command, into a temporary folder."""
  pytest.importorskip('sphinx')
  pytest.importorskip('myst_nb')
  if shutil.which('sphinx-build') is None:
    pytest.skip('sphinx-build not on PATH')
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'sphinx',
      '-W',
      '-q',
      '-b',
      'html',
      '-d',
      str(tmp_path / 'doctrees'),
      'docs',
      str(tmp_path / 'html'),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1800,
  )
  assert out.returncode == 0, out.stderr[-5000:]
  assert (tmp_path / 'html' / 'api' / 'registries.html').exists()
