"""The calibration pass: streaming input statistics of every weight op.

`collect(target, batches)` runs the FLOAT model on each calibration batch
(one jitted program per batch shape) and returns, per weight op a rule
quantizes, the `LayerStats` of its activation operand: the program
returns one batch's stats as its outputs and the host merges them
(`stats.merge`); no activation is stored.

The hook is where each adapter hands a weight op to the engine, with its
activation, weight, dimension numbers and config in hand:

  * models quantized by rules (`aqtr.flax.quantize`, linen and nnx): the
    interception `Session` calls a tap with each `WeightSite` (the weights
    `aqtr.flax.convert` freezes) instead of the quantized dot;
  * Pax-style templates (`aqtr.pax` ops injected with `aqtr.pax.inject`):
    every `EinsumOp` whose config quantizes its weight (rhs) reports to
    the recording observer (`aqtr.flax.intercept.recorder`) and runs the
    float einsum (the ops `aqtr.flax.convert` freezes).

The target is the model's host (`aqtr.flax.hosts.of`): the pass is the
same for every model kind.

Both return the float op's output, so every op sees the float model's
activations. Ops under `jax.lax.scan` (scanned layers) are not supported:
the pass raises one line saying so.

Example:
  >>> import jax.numpy as jnp, aqtr
  >>> from flax import nnx
  >>> lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  >>> q = aqtr.flax.quantize(lin, [aqtr.rules.Rule('int8')])
  >>> from aqtr.flax import hosts
  >>> got = collect(hosts.of(q), [jnp.ones((2, 4))])
  >>> list(got.stats), float(got.stats['dot_general0'].count)
  (['dot_general0'], 2.0)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from aqtr.flax import hosts, intercept
from aqtr.flax.session import swapped
from aqtr.flax.sites import WeightSite
from aqtr.ptq.stats import LayerStats, merge

# The pass's record of one weight op is the common weight site: its
# `op_path`, `dimension_numbers` (weight on the rhs), `config`, `other`
# (the activation operand) and `weight` as the pass's dot read them, and
# `holder` (rules models: where `aqtr.flax.convert` writes its entry).
Site = WeightSite


@dataclasses.dataclass
class Collected:
  """What the pass found: {op path: WeightSite}, {op path: LayerStats},
  {op path: W}."""

  sites: dict
  stats: dict
  weights: dict


def input_matrix(lhs: jax.Array, dn) -> jax.Array:
  """The activation as [tokens, d_in], d_in ordered like `as_matrix`'s.

  The weight's contraction dims are sorted (its own axis order); the
  activation's contraction dims follow the pairing of `dn`.
  """
  (lc, rc), (lb, _) = dn
  if lb:
    raise ValueError(
      f'aqtr.ptq: a weight op with batch dimensions ({dn}) is not supported '
      '(each batch index is its own weight matrix); leave it out of the '
      'rules.'
    )
  order = sorted(range(len(rc)), key=lambda i: rc[i])
  kdims = [lc[i] for i in order]
  rest = [d for d in range(jnp.ndim(lhs)) if d not in kdims]
  x = jnp.transpose(lhs, rest + kdims)
  d_in = 1
  for d in kdims:
    d_in *= jnp.shape(lhs)[d]
  return x.reshape(-1, d_in)


class _Recorder:
  """Collects each weight op's input statistics while a program runs.

  The statistics and the weight leave the program through host callbacks
  (`jax.debug.callback`), so ops under `remat` (or any transform that
  traces its body apart) are recorded too; `host` gathers them per batch.
  """

  def __init__(self, host: dict):
    self.sites: dict[str, WeightSite] = {}
    self.host = host

  def record_op(self, site: WeightSite, lhs, rhs) -> None:
    """One weight op (`aqtr.flax.intercept.recorder`): record its input.

    Args:
      site: the op (its dimension numbers: weight on the rhs).
      lhs, rhs: the activation and the weight, as the dot reads them.
    """
    site = dataclasses.replace(
      site,
      other=jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs)),
      weight=jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs)),
      op=None,
    )
    x = input_matrix(lhs, site.dimension_numbers)
    s = LayerStats.from_activations(x)
    self.sites.setdefault(site.op_path, site)
    jax.debug.callback(
      functools.partial(_host_record, self.host, site.op_path), tuple(s), rhs
    )

  def append(self, session) -> None:
    """As an interception observer: tap each new Session."""
    session.tap = self.tap

  def tap(self, site: WeightSite):
    """One weight op of a rules model: record, then run it in float."""
    if site.in_loop:
      raise ValueError(
        f'aqtr.ptq: {site.op_path} runs inside a loop body (scan over '
        'layers); the calibration pass needs the layers unrolled.'
      )

    def dot(lhs, rhs, dn, precision, preferred):
      self.record_op(dataclasses.replace(site, dimension_numbers=dn), lhs, rhs)
      return jax.lax.dot_general(
        lhs, rhs, dn, precision=precision, preferred_element_type=preferred
      )

    op = site.op
    run = swapped(dot) if site.side == 'lhs' else dot
    with intercept.quiet():
      return op.run(run, op.lhs, op.rhs)


def _host_record(host: dict, path: str, stats, weight) -> None:
  """Host side of `_Recorder.record_op`: merge one op's statistics."""
  s = LayerStats(*(jnp.asarray(x) for x in stats))
  old = host['stats'].get(path)
  host['stats'][path] = s if old is None else merge(old, s)
  host['weights'].setdefault(path, jnp.asarray(weight))


def _as_args(batch) -> tuple:
  return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def _shapes(args) -> tuple:
  return tuple(
    (tuple(jnp.shape(a)), str(jnp.result_type(a)))
    for a in jax.tree.leaves(args)
  )


def _check_finite(i: int, args) -> None:
  """One line when calibration batch `i` holds a NaN or inf."""
  for leaf in jax.tree.leaves(args):
    a = jnp.asarray(leaf)
    if jnp.issubdtype(a.dtype, jnp.inexact) and not bool(jnp.isfinite(a).all()):
      n = int(jnp.size(a) - jnp.isfinite(a).sum())
      raise ValueError(
        f'aqtr.ptq: calibration batch {i} holds {n} non-finite values (NaN '
        'or inf); give finite calibration inputs.'
      )


def _check_weights(weights: dict) -> None:
  """One line naming a weight op whose float weight holds a NaN or inf."""
  for path, w in weights.items():
    bad = ~jnp.isfinite(w)
    if bool(bad.any()):
      first = tuple(int(i[0]) for i in jnp.nonzero(bad))
      raise ValueError(
        f'aqtr.ptq: {path}: the float weight holds {int(bad.sum())} '
        f'non-finite values (NaN or inf; first at index {first}); fix the '
        'float weights before quantizing.'
      )


def collect(target: hosts.Host, batches: Iterable) -> Collected:
  """Streams the calibration batches through the float model.

  Args:
    target: the model's host (`aqtr.flax.hosts.of`): a model quantized by
      rules, or an `aqtr.pax.inject`ed template with its variables.
    batches: the calibration inputs; each an array (the model's one
      positional input) or a tuple of positional inputs. All batches have
      the first one's shapes and dtypes.

  Returns:
    `Collected`: per weight op path its WeightSite, merged LayerStats and
    the weight as the op read it.

  Raises:
    ValueError: no batch, a batch of other shapes than the first, a batch
      the model cannot run, a non-finite batch, weight or layer input, no
      weight op matched, scanned layers.
  """
  fn, state = target.program()
  meta: dict = {}
  host: dict = {'stats': {}, 'weights': {}}

  def program(state, args):
    rec = _Recorder(host)
    stack = intercept.context().observers
    stack.append(rec)
    try:
      fn(state, *args)
    finally:
      stack.remove(rec)
    meta['sites'] = rec.sites

  jitted = jax.jit(program)
  total, weights, want = None, None, None
  for i, batch in enumerate(batches):
    args = _as_args(batch)
    got = _shapes(args)
    if want is None:
      want = got
    elif got != want:
      raise ValueError(
        f'aqtr.ptq: calibration batch {i} has shapes {got}, batch 0 has '
        f'{want}; give every batch the same shapes.'
      )
    host['stats'], host['weights'] = {}, {}
    try:
      jitted(state, args)
      jax.effects_barrier()
      stats, w = host['stats'], host['weights']
    except jax.errors.UnexpectedTracerError:
      raise ValueError(
        'aqtr.ptq: a weight op ran inside a JAX transform (scan over '
        'layers?); the calibration pass needs the layers unrolled.'
      ) from None
    except (TypeError, ValueError) as e:
      if i or str(e).startswith('aqtr.ptq'):
        raise
      raise ValueError(
        f'aqtr.ptq: calibration batch 0 (shapes {got}) does not run through '
        f'the model: {e}'
      ) from e
    _check_finite(i, args)
    if i == 0:
      weights = w
      _check_weights(w)
    for k, v in stats.items():
      if not bool(jnp.isfinite(v.xtx).all()):
        raise ValueError(
          f'aqtr.ptq: {k}: its input on calibration batch {i} holds '
          'non-finite values (NaN or inf) although the batch is finite: '
          'a non-finite weight or overflow upstream; fix the float model.'
        )
    total = (
      stats
      if total is None
      else {k: merge(total[k], v) for k, v in stats.items()}
    )
  if want is None:
    raise ValueError('aqtr.ptq: calibration_batches is empty; give >= 1.')
  if not total:
    raise ValueError(
      'aqtr.ptq: no weight op of the model matched a rule that quantizes '
      'its weight (rhs); check the rules (aqtr.flax.report / '
      'aqtr.pax.inject report the matched ops).'
    )
  return Collected(meta['sites'], total, weights)


__all__ = ['Collected', 'Site', 'collect']
