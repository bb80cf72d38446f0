"""Structure metrics of the engine (aqtr/core), read from the source.

The targets of the engine refactor (one plan per call, typed operand
slots), each measured with `ast` on the source (no import of aqtr):

  slot literals   string literals in aqtr/core naming an operand slot:
                  'fwd.lhs', 'config.drhs.rhs', 'fwd.{side}.sparsity',
                  f'fwd.{side}', f'{pass_}.{side}', f'{name}.lhs' ... (a
                  pass name or a placeholder, a dot, a side name or a
                  placeholder; two placeholders count when they name a
                  pass and a side). Docstrings do not count.   target <= 12
  wide functions  functions in aqtr/core and aqtr/freezers with more than
                  8 parameters (positional + keyword-only, not self/cls),
                  the public lax drop-ins excepted.             target 0
  globals         `global` statements in aqtr/core.            target 0
  layout calls    `DotLayout.create(...)` call sites in aqtr/core.
                                                                target <= 2
  residual fields fields of the largest dataclass in aqtr/core whose name
                  ends in 'Residual' or 'Residuals'.           target <= 8

and, for information, the modules that use `jax.custom_vjp` (one is the
design) and the lines of each core module.

Run: python benchmarks/engine_metrics.py [--details]
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / 'aqtr' / 'core'
FREEZERS = ROOT / 'aqtr' / 'freezers'

# The public lax drop-ins: their signatures are lax's, wide by design.
DROP_INS = frozenset(
  {'dot_general', 'ragged_dot', 'einsum', 'conv_general_dilated'}
)
MAX_PARAMS = 8
TARGETS = {
  'slot literals': 12,
  'wide functions': 0,
  'globals': 0,
  'layout calls': 2,
  'residual fields': 8,
}

_PLACE = r'\{[^{}]*\}'
_SLOT = re.compile(
  rf'(?<![\w{{}}])(?P<p>fwd|dlhs|drhs|{_PLACE})\.(?P<s>lhs|rhs|{_PLACE})'
  r'(?![\w{])'
)
_RESIDUALS = re.compile(r'Residuals?$')


def modules(root: pathlib.Path) -> dict[str, ast.Module]:
  """{relative path: parsed module} of every .py file under `root`."""
  return {
    str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
    for p in sorted(root.rglob('*.py'))
  }


def _docstrings(tree: ast.Module) -> set[int]:
  """ids of the docstring nodes of a module, its classes and functions."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(
      node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    ):
      body = node.body
      if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
      ):
        out.add(id(body[0].value))
  return out


def _template(node: ast.JoinedStr) -> str:
  """An f-string as text, with each placeholder as '{expression}'."""
  parts = []
  for v in node.values:
    if isinstance(v, ast.Constant):
      parts.append(str(v.value))
    else:
      parts.append('{' + ast.unparse(v.value) + '}')
  return ''.join(parts)


def is_slot_text(text: str) -> bool:
  """Whether `text` names an operand slot ('fwd.lhs', f'{pass_}.{side}').

  Example:
    >>> [is_slot_text(t) for t in ('config.fwd.rhs', '{name}.lhs',
    ...  '{pass_}.{side}', '{owner}.{field}', 'x.lhs_struct')]
    [True, True, True, False, False]
  """
  for m in _SLOT.finditer(text):
    p, s = m.group('p'), m.group('s')
    if not p.startswith('{') or not s.startswith('{'):
      return True
    if 'pass' in p and 'side' in s:
      return True
  return False


def slot_literals(trees: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
  """(file, line, text) of every slot-path string literal (no docstrings)."""
  out = []
  for path, tree in trees.items():
    docs = _docstrings(tree)
    inside = set()  # Constants that are parts of an f-string.
    for node in ast.walk(tree):
      if isinstance(node, ast.JoinedStr):
        inside.update(id(v) for v in node.values)
    for node in ast.walk(tree):
      if isinstance(node, ast.JoinedStr):
        text = _template(node)
      elif (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and id(node) not in inside
      ):
        text = node.value
      else:
        continue
      if is_slot_text(text):
        out.append((path, node.lineno, text))
  return sorted(out)


def _functions(tree: ast.Module) -> Iterator[tuple[ast.AST, bool, bool]]:
  """(function node, is a method, is module level) of every function."""
  stack = [(tree, False)]
  while stack:
    node, in_class = stack.pop()
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
        yield child, in_class, node is tree
        stack.append((child, False))
      elif isinstance(child, ast.ClassDef):
        stack.append((child, True))
      else:
        stack.append((child, in_class))


def num_params(fn: ast.FunctionDef, method: bool) -> int:
  """Positional + keyword-only parameters, less a method's self / cls."""
  a = fn.args
  names = [x.arg for x in a.posonlyargs + a.args]
  if method and names and names[0] in ('self', 'cls'):
    names = names[1:]
  return len(names) + len(a.kwonlyargs)


def wide_functions(
  trees: dict[str, ast.Module], limit: int = MAX_PARAMS
) -> list[tuple[str, int, str, int]]:
  """(file, line, name, parameters) of functions over `limit` parameters."""
  out = []
  for path, tree in trees.items():
    for fn, method, top in _functions(tree):
      if top and fn.name in DROP_INS:
        continue
      n = num_params(fn, method)
      if n > limit:
        out.append((path, fn.lineno, fn.name, n))
  return sorted(out)


def globals_(trees: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
  """(file, line, names) of every `global` statement."""
  return sorted(
    (path, node.lineno, ', '.join(node.names))
    for path, tree in trees.items()
    for node in ast.walk(tree)
    if isinstance(node, ast.Global)
  )


def layout_calls(trees: dict[str, ast.Module]) -> list[tuple[str, int]]:
  """(file, line) of every `DotLayout.create(...)` call."""
  out = []
  for path, tree in trees.items():
    for node in ast.walk(tree):
      f = getattr(node, 'func', None)
      if (
        isinstance(node, ast.Call)
        and isinstance(f, ast.Attribute)
        and f.attr == 'create'
        and (ast.unparse(f.value).split('.')[-1] == 'DotLayout')
      ):
        out.append((path, node.lineno))
  return sorted(out)


def _is_classvar(ann: ast.AST) -> bool:
  return 'ClassVar' in ast.unparse(ann)


def residual_records(
  trees: dict[str, ast.Module],
) -> list[tuple[str, str, int]]:
  """(file, class, fields) of classes named '...Residual(s)'."""
  out = []
  for path, tree in trees.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef) and _RESIDUALS.search(node.name):
        fields = [
          s
          for s in node.body
          if isinstance(s, ast.AnnAssign)
          and isinstance(s.target, ast.Name)
          and not _is_classvar(s.annotation)
        ]
        out.append((path, node.name, len(fields)))
  return sorted(out)


def custom_vjp_modules(trees: dict[str, ast.Module]) -> list[str]:
  """Modules that use `jax.custom_vjp` (attribute or imported name)."""
  out = []
  for path, tree in trees.items():
    for node in ast.walk(tree):
      hit = (isinstance(node, ast.Attribute) and node.attr == 'custom_vjp') or (
        isinstance(node, ast.ImportFrom)
        and any(a.name == 'custom_vjp' for a in node.names)
      )
      if hit:
        out.append(path)
        break
  return sorted(out)


def measure() -> dict:
  """Every metric: {name: (value, details)}."""
  core, freezers = modules(CORE), modules(FREEZERS)
  aqtr_all = modules(ROOT / 'aqtr')
  slots = slot_literals(core)
  wide = wide_functions(core | freezers)
  glob = globals_(core)
  calls = layout_calls(core)
  records = residual_records(core)
  return {
    'slot literals': (len(slots), slots),
    'wide functions': (len(wide), wide),
    'globals': (len(glob), glob),
    'layout calls': (len(calls), calls),
    'residual fields': (max((r[2] for r in records), default=0), records),
    'custom_vjp modules': (
      len(custom_vjp_modules(aqtr_all)),
      custom_vjp_modules(aqtr_all),
    ),
  }


def module_lines() -> list[tuple[str, int]]:
  """(file, lines) of every core module."""
  return [
    (str(p.relative_to(ROOT)), len(p.read_text().splitlines()))
    for p in sorted(CORE.rglob('*.py'))
  ]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--details', action='store_true', help='list every hit')
  a = p.parse_args(argv)
  print('| metric | value | target |')
  print('|---|---:|---:|')
  results = measure()
  for name, (value, _) in results.items():
    target = TARGETS.get(name)
    t = '-' if target is None else f'<= {target}'
    print(f'| {name} | {value} | {t} |')
  lines = module_lines()
  total = sum(n for _, n in lines)
  print(f'\nLines per core module ({len(lines)} modules, {total} lines):\n')
  print('| module | lines |')
  print('|---|---:|')
  for path, n in lines:
    print(f'| {path} | {n} |')
  if a.details:
    for name, (_, hits) in results.items():
      print(f'\n{name}:')
      for h in hits:
        print('  ' + (h if isinstance(h, str) else ':'.join(map(str, h))))


if __name__ == '__main__':
  main()
