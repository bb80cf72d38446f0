"""Sphinx configuration of aqtr's documentation site.

Build (from the repository root, after `pip install -e '.[docs]'`):

  sphinx-build -W -b html docs docs/_build/html

Pages are MyST Markdown; the API reference is autodoc / autosummary over
the docstrings (Google style, napoleon). The notebooks of colabs/ are
copied into docs/notebooks/ (generated, not in git) and rendered by
myst-nb: a notebook executed by tests/colabs/test_notebooks.py (its copy
with outputs, under docs/_build/executed/) is rendered as executed;
otherwise myst-nb executes it once at toy size (AQTR_COLAB_SMALL=1),
because git holds the notebooks without outputs.
"""

import importlib
import json
import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

from sphinx.util.docutils import SphinxDirective  # noqa: E402

import aqtr  # noqa: E402

project = 'aqtr'
author = 'the aqtr authors'
copyright = '2026, the aqtr authors'  # noqa: A001
release = aqtr.__version__

extensions = [
  'myst_nb',
  'sphinx.ext.autodoc',
  'sphinx.ext.autosummary',
  'sphinx.ext.napoleon',
  'sphinx.ext.viewcode',
]

exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store', 'README.md']
source_suffix = {'.md': 'myst-nb', '.ipynb': 'myst-nb'}
root_doc = 'index'
# `name` in docstrings and eval-rst blocks is code, as in the Markdown.
default_role = 'code'
# Literal blocks in docstrings are plain text (maps, formulas), not Python.
highlight_language = 'none'

# MyST: headings get anchors (page.md#section links), $math$, definitions.
myst_enable_extensions = ['colon_fence', 'dollarmath', 'deflist']
myst_heading_anchors = 3

# Notebooks: copied from colabs/ (executed copies preferred), see above.
# AQTR_DOCS_NB_EXECUTION=off: a quick build that renders no outputs.
nb_execution_mode = os.environ.get('AQTR_DOCS_NB_EXECUTION', 'auto')
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_execution_show_tb = True
os.environ.setdefault('AQTR_COLAB_SMALL', '1')
os.environ['PYTHONPATH'] = os.pathsep.join(
  [str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])]
)

EXECUTED = DOCS / '_build' / 'executed'


def _copy_notebooks() -> None:
  """colabs/*.ipynb -> docs/notebooks/, with outputs where a test ran it."""
  out = DOCS / 'notebooks'
  out.mkdir(exist_ok=True)
  names = set()
  for src in sorted((ROOT / 'colabs').glob('*.ipynb')):
    names.add(src.name)
    done = EXECUTED / src.name
    fresh = done.exists() and done.stat().st_mtime >= src.stat().st_mtime
    book = json.loads((done if fresh else src).read_text())
    if fresh:  # rendered as executed (a cell without output is not missing)
      book['metadata']['mystnb'] = {'execution_mode': 'off'}
    text = json.dumps(book, indent=1) + '\n'
    dst = out / src.name
    if not dst.exists() or dst.read_text() != text:
      dst.write_text(text)
  for stale in out.glob('*.ipynb'):
    if stale.name not in names:
      stale.unlink()


_copy_notebooks()

# API reference: autodoc + autosummary from the docstrings.
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {
  'members': True,
  'show-inheritance': True,
  'member-order': 'bysource',
}
autodoc_typehints = 'description'
autodoc_typehints_format = 'short'
autodoc_class_signature = 'mixed'
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
add_module_names = False
python_use_unqualified_type_names = True

# Broken references fail the build (nitpicky, with -W). Type hints name
# classes the site does not document (jax, flax, numpy, typing, aqtr's
# internal modules): a class reference is checked only when it names a
# public name of a documented module (`aqtr.pax.Decoder`), so a written
# cross-reference to a missing API entry fails and a type hint does not.
nitpicky = True
_DOCUMENTED = sorted(
  {
    m
    for page in (DOCS / 'api').glob('*.md')
    for m in re.findall(r'^\.\. automodule:: (\S+)', page.read_text(), re.M)
  }
)
_PUBLIC = '|'.join(re.escape(m) for m in _DOCUMENTED)
nitpick_ignore_regex = [
  ('py:class', rf'(?!(?:{_PUBLIC})\.[A-Za-z]\w*$).*'),
  ('py:class', r'aqtr\.presets\.float'),  # the type float, in presets
  ('py:obj', r'.*\.T'),  # type variables
  ('py:exc', r'(?!aqtr\.).*'),  # builtin exceptions (no intersphinx)
]

html_theme = 'sphinx_book_theme'
html_title = f'aqtr {release}'
html_theme_options = {
  'show_toc_level': 2,
  'navigation_with_keys': False,
  'home_page_in_toc': True,
}
html_static_path = []


# A public name without a docstring fails the build (with -W): autodoc
# hands every documented object here, its docstring already split.
CHECKED = ('module', 'class', 'exception', 'function', 'method', 'property')


def _require_docstring(app, what, name, obj, options, lines):
  del app, options
  if what in CHECKED and not any(line.strip() for line in lines):
    if not name.rsplit('.', 1)[-1].startswith('_'):
      from sphinx.util import logging

      logging.getLogger('aqtr.docs').warning(
        f'{what} {name} has no docstring: add one (Google style, with an '
        'example).'
      )


# aqtr's docstrings are plain text (read in the code first): `name` spans,
# maps and formulas indented under a line, |x|, a * b. After napoleon has
# turned the Google sections into fields, this makes that text valid
# reStructuredText without changing what it says: an indented run under a
# prose line becomes a literal block (shown as written), and the inline
# markup characters outside `...` spans are escaped.
_SPAN = re.compile(r'(``.*?``|`[^`]*`)')


def _escape(text: str) -> str:
  parts = _SPAN.split(text)
  for i in range(0, len(parts), 2):
    s = parts[i].replace('\\', '\\\\')
    s = s.replace('*', '\\*').replace('|', '\\|')
    s = re.sub(r'(?<=\w)_(?=\W|$)', r'\\_', s)
    if i > 0 and re.match(r'\w', s):  # `Rule`s: end the span first
      s = '\\ ' + s
    if i + 1 < len(parts) and re.search(r'\w$', s):  # x`y`
      s += '\\ '
    parts[i] = s
  for i in range(1, len(parts), 2):  # autosummary ends a summary at '. '
    parts[i] = parts[i].replace('. ', '.\u200b ')
  return ''.join(parts)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _structural(line: str) -> bool:
  s = line.lstrip()
  return s.startswith(('..', ':', '- ', '* ', '>>>', '...')) or bool(
    re.match(r'\d+\. ', s)
  )


def _field(line: str) -> str:
  """Escapes a field line (`:param x: text`) but not its napoleon type."""
  head, _, body = line.partition(': ')
  head = re.sub(r'(?<!\\)\*', r'\\*', head)
  kind = re.match(r'\*[^*\s]+\* -- ', body)  # napoleon's `*type* -- `
  if kind:
    return f'{head}: {kind.group(0)}{_escape(body[kind.end() :])}'
  return f'{head}: {_escape(body)}'


def _kinds(lines: list[str]) -> list[tuple[str, str]]:
  """(kind, line): 'text', 'field', 'keep' (directives, code), 'blank'."""
  out: list[tuple[str, str]] = []
  literal = None  # indentation of the paragraph that opened a literal block
  doctest = False
  for line in lines:
    s = line.strip()
    if literal is not None:
      if not s or _indent(line) > literal:
        out.append(('keep', line))
        continue
      literal = None
      if out[-1][1].strip():
        out.append(('blank', ''))
    if doctest:
      if s:
        out.append(('keep', line))
        continue
      doctest = False
    if not s:
      out.append(('blank', line))
      continue
    if s.startswith('>>>'):
      if out and out[-1][1].strip():
        out.append(('blank', ''))
      doctest = True
      out.append(('keep', line))
      continue
    k = next(
      (i for i in range(len(out) - 1, -1, -1) if out[i][1].strip()), None
    )
    if k is not None and _indent(line) > _indent(out[k][1]):
      prev = out[k][1]
      if not _structural(prev) and (out[-1][1].strip() or prev.endswith(':')):
        del out[k + 1 :]
        colon = prev[:-1] + '::' if prev.endswith(':') else prev + ' ::'
        out[k] = (out[k][0], colon)
        out.append(('blank', ''))
        literal = _indent(prev)
        out.append(('keep', line))
        continue
    if s.startswith('..'):
      out.append(('keep', line))
    elif s.startswith(':') and ': ' in s[1:]:
      out.append(('field', line))
    else:
      out.append(('text', line))
  return out


def _rst_safe(lines: list[str]) -> list[str]:
  out: list[str] = []
  run: list[str] = []  # consecutive text lines: one paragraph, escaped whole
  for kind, line in _kinds(lines) + [('blank', '')]:
    if kind == 'text':
      run.append(line)
      continue
    if run:
      out.extend(_escape('\n'.join(run)).split('\n'))
      run = []
    out.append(_field(line) if kind == 'field' else line)
  return out[:-1]


def _process(app, what, name, obj, options, lines):
  lines[:] = _rst_safe(lines)
  _require_docstring(app, what, name, obj, options, lines)


class RegistryTable(SphinxDirective):
  """`registry-table FAMILY` (MyST pages): each registered name, its class."""

  required_arguments = 1

  def run(self):
    family = self.arguments[0]
    module = importlib.import_module(f'aqtr.{family}')
    rows = ['| registered name | class |', '|---|---|']
    for name in module.names():
      cls = module.get(name)
      ref = f'{{py:class}}`aqtr.{family}.{cls.__name__}`'
      rows.append(f'| `{name!r}` | {ref} |')
    return self.parse_text_to_nodes('\n'.join(rows))


def setup(app):
  app.connect('autodoc-process-docstring', _process)
  app.add_directive('registry-table', RegistryTable)
