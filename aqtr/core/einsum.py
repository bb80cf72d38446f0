"""Two-operand einsum through the quantized dot_general.

The subscripts are turned into dimension numbers with the first operand as
the dot's lhs, so a config's `lhs`/`rhs` mean the operands as written.
Letters that appear in only one operand and not in the output are summed
out (in float) before the dot; the dot output is transposed to the
requested order.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp

from aqtr.core import prims
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.qtensor import QTensor
from aqtr.core.rounding import as_typed_key
from aqtr.core.sharding import check_einsum_out_sharding, permute_sharding


def _expand(spec: str, rank: int, ell: str, field: str) -> str:
  if '...' in spec:
    n = rank - (len(spec) - 3)
    if n < 0:
      raise ValueError(
        f'einsum {field} {spec!r} has more letters than rank {rank}.'
      )
    spec = spec.replace('...', ell[len(ell) - n :] if n else '')
  if not all(c in string.ascii_letters for c in spec):
    raise ValueError(
      f'einsum {field} {spec!r} may only hold letters and one "...".'
    )
  if len(spec) != rank:
    raise ValueError(
      f'einsum {field} {spec!r} has {len(spec)} letters but the operand has '
      f'rank {rank}.'
    )
  if len(set(spec)) != len(spec):
    raise ValueError(
      f'einsum {field} {spec!r} repeats a letter (traces/diagonals are not '
      'supported).'
    )
  return spec


def parse(subscripts: str, lhs_rank: int, rhs_rank: int):
  """Returns (lhs, rhs, out) letter strings with '...' expanded."""
  s = subscripts.replace(' ', '')
  ins, arrow, out = s.partition('->')
  parts = ins.split(',')
  if len(parts) != 2:
    raise ValueError(
      f'aqtr.einsum takes exactly two operands, got subscripts {subscripts!r}.'
    )
  used = set(s) - set('.,->')
  ell = ''.join(c for c in string.ascii_letters[::-1] if c not in used)[:26]
  ell = ell[::-1]
  ls = _expand(parts[0], lhs_rank, ell, 'lhs subscripts')
  rs = _expand(parts[1], rhs_rank, ell, 'rhs subscripts')
  if arrow:
    n_ell = max(
      (
        r - (len(p) - 3)
        for p, r in zip(parts, (lhs_rank, rhs_rank), strict=True)
        if '...' in p
      ),
      default=0,
    )
    os = out.replace('...', ell[len(ell) - n_ell :]) if '...' in out else out
  else:
    counts = {c: (ls + rs).count(c) for c in ls + rs}
    lead = ''.join(c for c in ell if c in ls or c in rs)
    os = lead + ''.join(
      sorted(c for c, k in counts.items() if k == 1 and c not in lead)
    )
  unknown = sorted(set(os) - set(ls) - set(rs))
  if unknown:
    what = (
      'is not an input letter' if len(unknown) == 1 else 'are not input letters'
    )
    raise ValueError(
      f'einsum output {os!r}: {", ".join(map(repr, unknown))} {what} (lhs '
      f'{ls!r}, rhs {rs!r}); the output may only use input letters.'
    )
  if len(set(os)) != len(os):
    raise ValueError(
      f'einsum output {os!r} repeats a letter; use each input letter at '
      'most once.'
    )
  return ls, rs, os


def _ndim(x) -> int:
  return len(x.layout.shape) if isinstance(x, QTensor) else x.ndim


def _dn(ls: str, rs: str, os: str):
  batch = [c for c in ls if c in rs and c in os]
  contract = [c for c in ls if c in rs and c not in os]
  return (
    (
      tuple(ls.index(c) for c in contract),
      tuple(rs.index(c) for c in contract),
    ),
    (tuple(ls.index(c) for c in batch), tuple(rs.index(c) for c in batch)),
  )


def dimension_numbers(subscripts: str, lhs_rank: int, rhs_rank: int):
  """The dot_general dimension numbers `einsum(subscripts, ...)` uses.

  Use it with `aqtr.quantize_operand` to freeze an einsum operand.

  Example:
    >>> dimension_numbers('btd,df->btf', 3, 2)
    (((2,), (0,)), ((), ()))
  """
  ls, rs, os = parse(subscripts, lhs_rank, rhs_rank)
  if any(c not in rs and c not in os for c in ls) or any(
    c not in ls and c not in os for c in rs
  ):
    raise ValueError(
      f'einsum {subscripts!r} sums an axis before the dot; its operands do '
      'not map onto one dot_general.'
    )
  return _dn(ls, rs, os)


def einsum(
  subscripts: str,
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  config: DotGeneralConfig | None = None,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
) -> jax.Array:
  """Quantized two-operand `jnp.einsum`; `config=None` is jnp.einsum exactly.

  `out_sharding` (a NamedSharding or PartitionSpec of the output, as in
  jnp.einsum) is handed to the dot in its output order.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    >>> aqtr.einsum('btd,df->btf', x, w, config=aqtr.presets.int8()).shape
    (2, 3, 5)
  """
  as_typed_key(key)  # Checked even where unused (float configs).
  check_einsum_out_sharding(out_sharding, subscripts)
  given = isinstance(lhs, QTensor) or isinstance(rhs, QTensor)
  if not given and (
    config is None or (isinstance(config, DotGeneralConfig) and config.is_float)
  ):
    return prims.einsum(
      subscripts,
      lhs,
      rhs,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
  lhs, rhs = (
    x if isinstance(x, QTensor) else jnp.asarray(x) for x in (lhs, rhs)
  )
  ls, rs, os = parse(subscripts, _ndim(lhs), _ndim(rhs))
  lonly = [i for i, c in enumerate(ls) if c not in rs and c not in os]
  ronly = [i for i, c in enumerate(rs) if c not in ls and c not in os]
  for only, x, name in ((lonly, lhs, 'lhs'), (ronly, rhs, 'rhs')):
    if only and isinstance(x, QTensor):
      raise ValueError(
        f'einsum {subscripts!r} sums axes of the QTensor {name} before the '
        'dot; quantize the summed operand instead.'
      )
  if lonly:
    lhs = lhs.sum(axis=tuple(lonly))
    ls = ''.join(c for i, c in enumerate(ls) if i not in lonly)
  if ronly:
    rhs = rhs.sum(axis=tuple(ronly))
    rs = ''.join(c for i, c in enumerate(rs) if i not in ronly)
  dn = _dn(ls, rs, os)
  batch = [c for c in ls if c in rs and c in os]
  got = (
    ''.join(batch)
    + ''.join(c for c in ls if c not in rs)
    + ''.join(c for c in rs if c not in ls)
  )
  out = dot_general(
    lhs,
    rhs,
    dn,
    config,
    key=key,
    precision=precision,
    preferred_element_type=preferred_element_type,
    out_sharding=permute_sharding(out_sharding, [os.index(c) for c in got]),
  )
  if got != os:
    out = out.transpose(tuple(got.index(c) for c in os))
  return out
