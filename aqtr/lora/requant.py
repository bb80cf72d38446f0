"""Re-quantizing merged LoRA weights: round to nearest or an `aqtr.ptq` solver.

`aqtr.lora.merge` folds the adapters into float weights, `W' = W_deq +
A B alpha / r`, then calls `requantized(merged, rules, ...)` (the same
composition serves any model `aqtr.ptq.quantize` takes, Pax templates
included). Re-rounding W' to nearest on fresh scales costs a whole new
quantization error; a solver (GPTQ, Frantar et al. 2022, arXiv
2210.17323) instead minimizes the output error `||X (W' - Q)||^2` on
calibration inputs X of the fine-tuning domain, and `BaseGrid` keeps the
base's own grid (on which `W_deq` is exact).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.lora.adapters import attach
  >>> from aqtr.lora.config import LoraConfig
  >>> from aqtr.lora.merge import merge
  >>> x = jax.random.normal(jax.random.key(0), (32, 64))
  >>> m = attach(nnx.Linear(64, 8, rngs=nnx.Rngs(0)),
  ...            LoraConfig(rank=2, base='nf4'), x)
  >>> served, rep = merge(m, x, method='gptq', batches=[x], report=True)
  >>> rep.layers[0].error <= rep.layers[0].rtn_error
  True
"""

from __future__ import annotations

import dataclasses
import warnings

import aqtr.ptq as ptq
from aqtr.flax import hosts, serving
from aqtr.flax.quantized import quantize
from aqtr.ptq import gptq, methods
from aqtr.ptq.grid import Grid

__all__ = ['BaseGrid', 'check_solver', 'requantized']

_GRIDS = ('fresh', 'base')


def requantized(
  merged,
  rules,
  *args,
  variables=None,
  method='rtn',
  batches=None,
  grid='fresh',
  base_weights=None,
  **kwargs,
):
  """A float merged model quantized by `rules`: (served, PtqReport | None).

  The composition `merge` ends with, for any model `aqtr.ptq.quantize`
  takes (nnx, linen, a Pax template with `variables`): method 'rtn' on
  the fresh grid with no `batches` is `aqtr.flax.convert` of
  `aqtr.flax.quantize(merged, rules)` (no report; a Pax template: RTN
  by `aqtr.ptq.quantize` on the sample inputs, and its report); otherwise
  `aqtr.ptq.quantize(merged, rules, batches, method=...)`, with grid
  'base' on the grids of `base_weights` (`BaseGrid`).

  Args:
    merged: the float model with `W + A B alpha / r` in its weights.
    rules: the `aqtr.rules.Rule`s of the serving format.
    *args, **kwargs: sample inputs (and RTN's calibration batch when
      `batches` is None).
    variables: linen / Pax: the merged float variables.
    method: as `merge`'s.
    batches: calibration inputs (see `merge`).
    grid: as `merge`'s.
    base_weights: {op path ('/'.join(module path + op id), `aqtr.ptq`'s
      path): the base weight dequantized, in the weight's layout}: the
      grids grid='base' keeps (ops not in it: fresh grids).

  Returns:
    (served, report): served as the model kind's convert returns it.

  Raises:
    ValueError: one line for a bad method / grid / missing batches.
  """
  check_solver(method, batches, grid, False)
  pax = hosts.of(merged, variables, who='aqtr.lora.merge').by_injection
  if batches is None and _is_rtn(method) and grid == 'fresh' and not pax:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      return serving.convert(
        quantize(merged, rules),
        *args,
        variables=variables,
        check=False,
        **kwargs,
      ), None
  if batches is None:
    if kwargs or not _is_rtn(method):
      raise ValueError(
        f'aqtr.lora.merge: method={_name(method)!r} needs batches= of '
        'positional model inputs.'
      )
    batches = [args if len(args) != 1 else args[0]]
  meth = methods.get(method)
  if grid != 'fresh':
    meth = BaseGrid(then=meth, weights=base_weights or {})
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    return ptq.quantize(
      merged, rules, batches, variables=variables, method=meth
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseGrid(methods.Method):
  """A solver on the base weight's grid instead of the merged weight's.

  The grid (scales, zero points) of op `p` is the one the rule's
  calibration gives `weights[p]`, the base dequantized: for absmax
  formats that is the base's own grid (`W_deq` is exact on it), so the
  merged `W_deq + D` only moves the codes D carries across a boundary.
  `then` (RTN or GPTQ, arXiv 2210.17323) solves the merged weight on
  it; ops missing from `weights` keep the fresh grid.

  Attributes:
    then: the solver: `aqtr.ptq.Rtn()` or `aqtr.ptq.Gptq(...)`
      (static groups: the grid is given).
    weights: {op path: base weight dequantized, in the weight's layout}.
  """

  then: methods.Method = dataclasses.field(default_factory=ptq.Rtn)
  weights: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    t = self.then
    ok = isinstance(t, ptq.Rtn) or (isinstance(t, ptq.Gptq) and t.static_groups)
    if not ok:
      raise ValueError(
        "BaseGrid.then must solve on a given grid: 'rtn' or 'gptq' with "
        f'static_groups=True, got {t!r}.'
      )

  def check(self, site) -> None:
    self.then.check(site)

  def solve(self, site, grid: Grid, stats) -> gptq.Solution:
    w = self.weights.get(site.op_path)
    if w is None:
      return self.then.solve(site, grid, stats)
    base = Grid.of(site, w)
    kept = dataclasses.replace(grid, scale2=base.scale2, zero2=base.zero2)
    sol = self.then.solve(site, kept, stats)
    return sol._replace(scale=kept.scale2, zero=kept.zero2)


def _is_rtn(method) -> bool:
  return isinstance(method, ptq.Rtn) or (
    isinstance(method, str) and method == 'rtn'
  )


def check_solver(
  method, batches, grid, report, requantize='base', float_bases=False
) -> None:
  """One line for each bad combination of merge's solver arguments
  (`float_bases`: every adapted weight's base is float)."""
  if not isinstance(method, ptq.Method) and method not in methods.names():
    raise ValueError(
      f'aqtr.lora.merge: method must be one of {methods.names()} or an '
      f'aqtr.ptq.Method, got {method!r}.'
    )
  if grid not in _GRIDS:
    raise ValueError(
      f"aqtr.lora.merge: grid must be 'fresh' or 'base', got {grid!r}."
    )
  base = isinstance(requantize, str) and requantize == 'base'
  floats = requantize is None or (base and float_bases)
  if floats and not (_is_rtn(method) and grid == 'fresh'):
    why = 'requantize=None' if requantize is None else 'float bases'
    raise ValueError(
      f'aqtr.lora.merge: the merged weights are float ({why}): there is '
      f'nothing for method={_name(method)!r} / grid={grid!r} to solve; '
      'drop them or requantize to a quantized format.'
    )
  if grid != 'fresh' and not base:
    raise ValueError(
      f"aqtr.lora.merge: grid={grid!r} keeps the base's scales, so it needs "
      f"requantize='base', got requantize={requantize!r}."
    )
  needs = [
    w
    for w, yes in (
      (f'method={_name(method)!r}', not _is_rtn(method)),
      ('report=True', report),
    )
    if yes
  ]
  if batches is None and needs:
    raise ValueError(
      f'aqtr.lora.merge: {" with ".join(needs)} needs batches= (calibration '
      "inputs of the fine-tuning domain); only method='rtn' needs none."
    )


def _name(method) -> str:
  return method if isinstance(method, str) else type(method).name
