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

import os
import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

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

# MyST: headings get anchors (page.md#section links), $math$, definitions.
myst_enable_extensions = ['colon_fence', 'dollarmath', 'deflist']
myst_heading_anchors = 3

# Notebooks: copied from colabs/ (executed copies preferred), see above.
nb_execution_mode = 'auto'
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
    dst = out / src.name
    chosen = done if fresh else src
    if not dst.exists() or dst.read_bytes() != chosen.read_bytes():
      shutil.copyfile(chosen, dst)
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
autodoc_class_signature = 'separated'
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = False
python_use_unqualified_type_names = True

# Type hints name jax / flax / optax types the site does not document;
# they render as text instead of failing the build.
nitpicky = False

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
    parts[i] = re.sub(r'(?<=\w)_(?=\W|$)', r'\\_', s)
  return ''.join(parts)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _structural(line: str) -> bool:
  s = line.lstrip()
  return s.startswith(('..', ':', '- ', '* ', '>>>', '...')) or bool(
    re.match(r'\d+\. ', s)
  )


def _rst_safe(lines: list[str]) -> list[str]:
  out: list[str] = []
  literal = None  # indentation of the paragraph that opened a literal block
  doctest = False
  for line in lines:
    s = line.strip()
    if literal is not None:
      if not s or _indent(line) > literal:
        out.append(line)
        continue
      literal = None
    if doctest:
      if s:
        out.append(line)
        continue
      doctest = False
    if s.startswith('>>>'):
      if out and out[-1].strip():
        out.append('')
      doctest = True
      out.append(line)
      continue
    prev = next((x for x in reversed(out) if x.strip()), None)
    if s and prev is not None and _indent(line) > _indent(prev):
      if not _structural(prev) and (out[-1].strip() or prev.endswith(':')):
        if not out[-1].strip():
          out.pop()
        k = max(i for i, x in enumerate(out) if x.strip())
        out[k] = out[k][:-1] + '::' if out[k].endswith(':') else out[k] + ' ::'
        out.append('')
        literal = _indent(out[k])
        out.append(line)
        continue
    if s.startswith('..'):
      out.append(line)
    elif s.startswith(':') and ': ' in s[1:]:
      head, _, body = line.partition(': ')
      out.append(f'{head}: {_escape(body)}')
    else:
      out.append(_escape(line))
  return out


def _process(app, what, name, obj, options, lines):
  lines[:] = _rst_safe(lines)
  _require_docstring(app, what, name, obj, options, lines)


def setup(app):
  app.connect('autodoc-process-docstring', _process)
