"""Float rewrites of a calibrated model's parameters (AWQ, SmoothQuant).

`aqtr.ptq.quantize` hands a method its target (a model quantized by
rules, or an injected Pax template, with its variables) and the
calibration pass's `Collected` (per weight op: `WeightSite`,
`LayerStats`, the weight). The scale solvers work on a nested dict of
parameters and on stats keyed by weight PARAMETER path (the paths `fold`
maps name). This module translates both ways:

  params_of(target)               the target's parameters (nested dict)
  weight_paths(target, got)       {op path: its weight's parameter path}
  apply(target, got, fn)          runs fn(params, stats by parameter) ->
                                  (params, stats) and returns the new
                                  target and Collected

nnx models: the pure dict of their `nnx.Param`s ('blocks/0/q/kernel');
linen models and Pax templates: their variables ('params/...').

Example:
  >>> import jax.numpy as jnp, aqtr
  >>> from flax import nnx
  >>> from aqtr.flax import hosts
  >>> from aqtr.ptq.collect import collect
  >>> lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  >>> t = hosts.of(aqtr.flax.quantize(lin, [aqtr.rules.Rule('int8')]))
  >>> weight_paths(t, collect(t, [jnp.ones((2, 4))]))
  {'dot_general0': 'kernel'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np

from aqtr.ptq import fold
from aqtr.ptq.collect import Collected
from aqtr.ptq.stats import LayerStats

__all__ = ['apply', 'fold_map_of', 'params_of', 'weight_paths', 'with_params']


def params_of(target) -> dict:
  """The target's float parameters as a nested dict (`param_tree`)."""
  return target.param_tree()


def with_params(target, params: Mapping):
  """A new target holding `params` (the given target is unchanged)."""
  return target.with_param_tree(params)


def _by_value(params: Mapping, op_path: str, w) -> str:
  """The parameter of the op's module that holds weight `w` (by value)."""
  parent = 'params/' + op_path.rpartition('/')[0]
  node = fold.get(params, parent)
  w = np.asarray(w)
  for name, leaf in node.items():
    if np.shape(leaf) == w.shape and np.array_equal(np.asarray(leaf), w):
      return f'{parent}/{name}'
  raise ValueError(
    f'aqtr.ptq: no parameter of {parent!r} holds the weight of {op_path!r}.'
  )


def weight_paths(target, got: Collected) -> dict[str, str]:
  """{op path: the parameter path of its weight} for every collected op.

  A rules model's op names its parameter (`WeightSite.holder`); an
  injected Pax op (no holder) reads a parameter of its own module, found
  by value.
  """
  out, params = {}, None
  for path, site in got.sites.items():
    if not site.holder:
      params = params_of(target) if params is None else params
      out[path] = _by_value(params, path, got.weights[path])
      continue
    mpath, param, _ = site.holder
    out[path] = '/'.join(map(str, target.tree_path((*mpath, param))))
  return out


def fold_map_of(fold_map, target, params: Mapping) -> fold.FoldMap:
  """`fold_map`, or the map registered for the target's model (`fold.find`)."""
  if fold_map is not None:
    return fold_map
  return fold.find(target.model, params)


def _is_transposed(param, w) -> bool:
  """Whether an op reads the matrix parameter `param` as its transpose
  (`w`: the weight the op read; GPT-2's Conv1D reads kernel.T)."""
  if np.ndim(param) != 2 or np.shape(param)[::-1] != np.shape(w):
    return False
  if np.shape(param) == np.shape(w) and np.array_equal(param, w):
    return False
  return bool(np.array_equal(np.asarray(param).T, np.asarray(w)))


Solver = Callable[[dict, dict, dict, dict], tuple[dict, dict]]


def apply(target, got: Collected, fn: Solver):
  """Runs a float rewrite on the target's parameters and stats.

  Args:
    target: the model's host (`aqtr.flax.hosts.of`).
    got: the calibration pass's result.
    fn: fn(params, stats, configs, contracting) -> (new params, new
      stats), the last three keyed by weight parameter path: the ops'
      input stats, weight configs (`fwd.rhs`) and contracting dims.

  Returns:
    (new target, new Collected: same sites, the rewritten weights and
    their ops' new input stats).
  """
  paths = weight_paths(target, got)
  params = params_of(target)
  by_param: dict[str, LayerStats] = {}
  configs, contracting, seen, flipped = {}, {}, set(), set()
  for op, p in paths.items():
    if p in seen:  # One weight read by two ops: no single input.
      by_param.pop(p, None)
      configs[p] = None
      continue
    seen.add(p)
    by_param[p] = got.stats[op]
    configs[p] = got.sites[op].config.fwd.rhs
    contracting[p] = got.sites[op].contracting
    if _is_transposed(fold.get(params, p), got.weights[op]):
      flipped.add(op)  # The op reads kernel.T (GPT-2's Conv1D).
      contracting[p] = tuple(1 - d % 2 for d in contracting[p])
  new_params, new_stats = fn(params, by_param, configs, contracting)
  new_target = with_params(target, new_params)
  stats = {op: new_stats.get(p, got.stats[op]) for op, p in paths.items()}
  weights = {}
  for op, p in paths.items():
    w = jax.numpy.asarray(fold.get(new_params, p))
    weights[op] = w.T if op in flipped else w
  return new_target, dataclasses.replace(got, stats=stats, weights=weights)
