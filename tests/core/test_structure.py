"""The engine's structure targets, read from the source with `ast`.

Each target of the engine refactor (one plan per call, typed operand
slots, per-side residuals; issue 20) is measured by
`benchmarks/engine_metrics.py`, which prints the same numbers; all are met
and held here.
"""

from __future__ import annotations

import ast
import textwrap

import pytest

from benchmarks import engine_metrics as em


def _trees(src: str) -> dict[str, ast.Module]:
  return {'m.py': ast.parse(textwrap.dedent(src))}


def _core():
  return em.modules(em.CORE)


# --- The targets --------------------------------------------------------


def test_slot_path_literals_in_core():
  hits = em.slot_literals(_core())
  assert len(hits) <= em.TARGETS['slot literals'], hits


def test_no_function_with_more_than_8_parameters():
  hits = em.wide_functions(_core() | em.modules(em.FREEZERS))
  assert not hits, hits


def test_no_global_statement_in_core():
  hits = em.globals_(_core())
  assert not hits, hits


def test_dot_layout_created_at_most_twice():
  hits = em.layout_calls(_core())
  assert len(hits) <= em.TARGETS['layout calls'], hits


def test_residual_records_have_at_most_8_fields():
  records = em.residual_records(_core())
  assert records, 'no residuals record found in aqtr/core'
  wide = [r for r in records if r[2] > em.TARGETS['residual fields']]
  assert not wide, wide


def test_custom_vjp_in_one_module():
  assert em.custom_vjp_modules(em.modules(em.ROOT / 'aqtr')) == [
    'aqtr/core/dot_general.py'
  ]


# --- The counters, on small sources ---------------------------------------


@pytest.mark.parametrize(
  'text, slot',
  [
    ('fwd.lhs', True),
    ('drhs.rhs', True),
    ('config.dlhs.rhs', True),
    ('fwd.{side}.sparsity', True),
    ('{pass_}.{side}', True),
    ('{name}.lhs.numerics', True),
    ('{owner}.{field}', False),
    ('x.lhs_struct', False),
    ('fwd', False),
    ('fwdx.lhs', False),
  ],
)
def test_is_slot_text(text, slot):
  assert em.is_slot_text(text) is slot


def test_slot_literals_count_fstrings_not_docstrings():
  src = '''
  """Module doc naming 'fwd.lhs'."""
  def f(side, pass_, owner, field):
    """Doc: 'dlhs.rhs'."""
    a = 'fwd.lhs'
    b = f'fwd.{side}'
    c = f'{pass_}.{side}'
    d = f'{owner}.{field}'
    return {'drhs.lhs': a}, b, c, d
  '''
  texts = [t for _, _, t in em.slot_literals(_trees(src))]
  assert texts == ['fwd.lhs', 'fwd.{side}', '{pass_}.{side}', 'drhs.lhs']


def test_wide_functions_count_kwonly_not_self_and_spare_drop_ins():
  src = """
  def narrow(a, b, c, d, e, f, g, *, h): ...
  def wide(a, b, c, d, e, f, g, *, h, i): ...
  def dot_general(a, b, c, d, e, f, g, h, i): ...
  class C:
    def method(self, a, b, c, d, e, f, g, h): ...
    def dot_general(self, a, b, c, d, e, f, g, h, i): ...
  """
  names = sorted((n, k) for _, _, n, k in em.wide_functions(_trees(src)))
  assert names == [('dot_general', 9), ('wide', 9)]


def test_globals_layout_calls_and_residual_fields():
  src = """
  import dataclasses
  from typing import ClassVar
  _x = 0
  def f(a, b, dn):
    global _x
    return DotLayout.create(a, b, dn), dimension_numbers.DotLayout.create(a)
  @dataclasses.dataclass
  class SideResidual:
    x: int = 0
    key: int = 0
    kind: ClassVar[str] = 'side'
  """
  trees = _trees(src)
  assert em.globals_(trees) == [('m.py', 6, '_x')]
  assert len(em.layout_calls(trees)) == 2
  assert em.residual_records(trees) == [('m.py', 'SideResidual', 2)]
