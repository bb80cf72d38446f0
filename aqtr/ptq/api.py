"""`aqtr.ptq.quantize`: calibrate, solve every weight, write a serving tree.

Pipeline: the calibration pass (`aqtr.ptq.collect`) streams the batches
through the float model; the method's float rewrites run
(`Method.rewrite`); round-to-nearest CONVERT builds the ordinary serving
tree (`aqtr.flax.convert`, or the Pax model's serving template and
`aqtr.flax.linen.convert`); then each weight op's frozen q-values are
replaced by the method's solution on the same grid (same scales), so the
tree is exactly the one CONVERT makes, SERVE runs it unchanged, and it
serves the solved weights bit for bit (`Grid.dequant`).

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> from flax import nnx
  >>> model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  >>> xs = [jax.random.normal(jax.random.key(i), (32, 16)) for i in range(2)]
  >>> rules = [aqtr.rules.Rule(aqtr.presets.int4_weight_only())]
  >>> served, rep = quantize(model, rules, xs, method='gptq')
  >>> served(xs[0]).shape, [r.path for r in rep.layers]
  ((32, 8), ['dot_general0'])
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax

from aqtr import rules as rules_lib
from aqtr.core import codecs
from aqtr.flax import hosts, quantized, serving
from aqtr.freezers import lifecycle
from aqtr.pax.inject import inject
from aqtr.ptq import methods
from aqtr.ptq.collect import collect
from aqtr.ptq.grid import Grid, weight_config
from aqtr.ptq.stats import relative_error


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """One solved weight op.

  Attributes:
    path: the op's path.
    d_in, d_out: the weight as a matrix.
    tokens: calibration tokens seen.
    rtn_error: round to nearest's relative output error
      `tr(dW^T X^T X dW) / tr(W^T X^T X W)` on the ORIGINAL float weight
      and inputs.
    error: the method's. For a method that rewrites the float model
      first (AWQ, SmoothQuant) it is measured on the rewritten weight and
      inputs (`X / s`, `diag(s) W`, AWQ's clip included in W): the fold
      leaves the float product unchanged, so the two are comparable up
      to AWQ's clipping, which this error does not count.
    seconds: the method's solve time (compile included), plus its share
      of the float rewrite (split evenly over the layers).
  """

  path: str
  d_in: int
  d_out: int
  tokens: int
  rtn_error: float
  error: float
  seconds: float


@dataclasses.dataclass(frozen=True)
class PtqReport:
  """What `quantize` did, per layer (`layers`), and its method."""

  method: methods.Method
  layers: tuple[LayerReport, ...]

  @property
  def seconds(self) -> float:
    return sum(r.seconds for r in self.layers)

  def __str__(self) -> str:
    head = (
      f'{"layer":40s} {"d_in x d_out":>13s} {"rtn err":>9s} '
      f'{self.method.name + " err":>10s} {"s":>6s}'
    )
    rows = [
      f'{r.path:40s} {f"{r.d_in}x{r.d_out}":>13s} {r.rtn_error:9.2e} '
      f'{r.error:10.2e} {r.seconds:6.2f}'
      for r in self.layers
    ]
    return '\n'.join([head, *rows])


def _target(model, rules, variables) -> hosts.Host:
  """The host of the model to calibrate, quantized / injected by `rules`."""
  who = 'aqtr.ptq.quantize'
  host = hosts.of(model, variables, who=who, need_variables=False)
  if host.by_injection:  # a Pax template: rules inject its ops
    if rules is not None:
      model, _ = inject(model, rules)
    return hosts.of(model, variables, who=who)
  if not hasattr(type(model), 'aqtr_spec'):
    if rules is None:
      raise TypeError(f'{who}: give rules= for a float model.')
    model = quantized.quantize(model, rules_lib.as_rules(rules, 'rules'))
  elif rules is not None:
    raise ValueError(
      f'{who}: the model is already quantized by rules; pass rules=None or '
      'the float model.'
    )
  return hosts.of(model, variables, who=who)


def _convert(target: hosts.Host, args) -> hosts.Host:
  """RTN CONVERT: the served model's host (solved parts go in with
  `put_frozen`). No serve == train check: solved values replace RTN's."""
  served = serving.convert(
    target.model, *args, variables=target.variables, check=False
  )
  return hosts.served(served, who='aqtr.ptq.quantize')


def _entry(site) -> str:
  return lifecycle.entry_name(weight_config(site.config))


def quantize(
  model,
  rules,
  calibration_batches,
  *,
  variables=None,
  method='gptq',
  **options,
):
  """Post-training quantization of a float model by rules.

  Args:
    model: a float flax linen / nnx Module (quantized here by `rules`
      with `aqtr.flax.quantize`; or one already quantized, rules=None), or
      a Fiddle template of an `aqtr.pax` model (injected here with
      `aqtr.pax.inject(model, rules)`; or already injected, rules=None).
    rules: `aqtr.rules.Rule`s in priority order; each matched weight op's
      config sets the grid (numerics, calibration, tiling) it is solved on.
    calibration_batches: an iterable of model inputs (an array, or a tuple
      of positional inputs), all of the first one's shapes.
    variables: linen and Pax: the float variables (nnx: None).
    method: a registered name ('rtn', 'gptq', ...; `methods.names()`) or
      a `methods.Method` instance.
    **options: the method's fields when `method` is a name (e.g.
      `act_order=True`).

  Returns:
    (served, report): `served` as the model kind's convert returns it
    (nnx: the serving model; linen: (module, variables); Pax: (serving
    template in Mode.SERVE, variables)), and a `PtqReport`.

  Raises:
    ValueError / TypeError: one line for a bad method, batch, rule config
      the method cannot use, or a model with no matched weight op.
  """
  meth = methods.get(method, **options)
  target = _target(model, rules, variables)
  batches = list(calibration_batches)
  got = collect(target, batches)
  for site in got.sites.values():
    meth.check(site)
  rtn0 = {}
  rewrites = type(meth).rewrite is not methods.Method.rewrite
  if rewrites:  # RTN's error on the original weights, before the rewrite.
    for path, site in got.sites.items():
      g = _grid(site, got.weights[path], path)
      rtn0[path] = relative_error(
        g.dequant(g.rtn) - g.w2, g.w2, got.stats[path].xtx
      )
  t0 = time.perf_counter()
  target, got = meth.rewrite(target, got)
  share = (time.perf_counter() - t0) / max(len(got.sites), 1)
  grids = {}
  for path, site in got.sites.items():
    grids[path] = _grid(site, got.weights[path], path)
  first = batches[0]
  args = tuple(first) if isinstance(first, tuple | list) else (first,)
  served = _convert(target, args)
  layers = []
  for path, site in got.sites.items():
    stats = got.stats[path]
    if _few(stats):
      warnings.warn(
        f'aqtr.ptq: {path}: {int(stats.count)} calibration tokens for '
        f'd_in={stats.d_in}: H is singular; dampening (percdamp) keeps '
        'it invertible, give more calibration tokens.',
        UserWarning,
        stacklevel=2,
      )
    grid = grids[path]
    t0 = time.perf_counter()
    sol = jax.block_until_ready(meth.solve(site, grid, stats))
    secs = time.perf_counter() - t0 + (share if rewrites else 0.0)
    parts = grid.parts(sol.q, sol.scale, sol.zero)
    if not isinstance(meth, methods.Rtn):  # Stored as CONVERT stores.
      parts = codecs.encode_parts(parts, grid.numerics)
      served.put_frozen(site.op_path, site.holder, _entry(site), parts)
    w2 = grid.w2
    rtn = rtn0.get(path)
    if rtn is None:
      rtn = relative_error(grid.dequant(grid.rtn) - w2, w2, stats.xtx)
    err = relative_error(grid.dequant(parts) - w2, w2, stats.xtx)
    d_in, d_out = w2.shape
    layers.append(
      LayerReport(path, d_in, d_out, int(stats.count), rtn, err, secs)
    )
  return served.result(), PtqReport(meth, tuple(layers))


def _grid(site, w, path: str) -> Grid:
  try:
    return Grid.of(site, w)
  except (ValueError, TypeError) as e:
    raise type(e)(f'aqtr.ptq: {path}: {e}') from None


def _few(stats) -> bool:
  return bool(float(stats.count) < stats.d_in)


__all__ = ['LayerReport', 'PtqReport', 'quantize']
