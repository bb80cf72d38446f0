"""Which (name, check) pairs of a registry's contract test run by default.

A contract test crosses every registered name with every check of its
`aqtr.testing` module. The checks through the dot engine (`check_engine`:
`aqtr.dot_general` against its references; `check_ragged`: the same on
`aqtr.ragged_dot`) compile a dozen programs per name and take most of the
test's time, so by default each name runs every other check and ONE of the
engine checks, alternating over the sorted names (name i runs
`heavy[i % len(heavy)]`): every registered name still goes through the
engine, and each engine check still meets several names. The other pairs
are marked `slow` (`pytest -m slow` runs the full cross-product).
"""

from collections.abc import Callable, Sequence

import pytest

HEAVY = ('check_engine', 'check_ragged')


def cases(
  names: Sequence[str],
  checks: Sequence[Callable],
  heavy: Sequence[str] = HEAVY,
) -> list:
  """`pytest.param(name, check)` for every pair, the extra heavy ones slow.

  Args:
    names: the registry's names.
    checks: the contract's checks (functions named `check_*`).
    heavy: the names of the checks that run on one name in len(heavy).

  Returns:
    One param per (name, check), id `name-check` without its `check_`.

  Example:
    >>> def check_builds(cls, bad): pass
    >>> def check_engine(cls, bad): pass
    >>> def check_ragged(cls, bad): pass
    >>> params = cases(['a', 'b'], [check_builds, check_engine, check_ragged])
    >>> [p.id for p in params if not p.marks]
    ['a-builds', 'a-engine', 'b-builds', 'b-ragged']
  """
  missing = set(heavy) - {c.__name__ for c in checks}
  if missing:
    raise ValueError(f'heavy names no check: {sorted(missing)}')
  params = []
  for i, name in enumerate(sorted(names)):
    mine = heavy[i % len(heavy)]
    for check in checks:
      slow = check.__name__ in heavy and check.__name__ != mine
      params.append(
        pytest.param(
          name,
          check,
          id=f'{name}-{check.__name__[6:]}',
          marks=[pytest.mark.slow] if slow else [],
        )
      )
  return params
