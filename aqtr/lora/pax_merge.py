"""LoRA Pax templates: adapters folded into the weights, and bytes.

`float_merged` folds each `LoraEinsum`'s adapter into its layer's weight,
`W' = W_deq + A B alpha / r` (`W_deq`: the frozen base dequantized), and
gives the float template with plain `aqtr.pax.EinsumOp`s; `aqtr.lora.merge`
then re-quantizes it (`aqtr.lora.requant`). `sizes` counts the bytes
training holds, as `aqtr.lora.sizes` does for stock models.

Example:
  >>> import jax, jax.numpy as jnp, aqtr.pax
  >>> from aqtr.lora.config import LoraConfig
  >>> from aqtr.lora.pax import attach
  >>> t = aqtr.pax.templates.feed_forward(64, 128)
  >>> x = jnp.ones((2, 64))
  >>> v = jax.jit(fdl.build(t).init)(jax.random.key(0), x)
  >>> lt, lv = attach(t, {'wi': LoraConfig(rank=4)}, x, variables=v)
  >>> sizes(lt, x, variables=lv).adapters  # (64 x 4 + 4 x 128) float32
  3072
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, NamedTuple

import fiddle as fdl
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from fiddle import selectors
from flax import traverse_util

import aqtr.flax.linen as aqtr_linen
from aqtr.flax.frozen import FrozenBox, is_removed
from aqtr.flax.sites import WeightSite
from aqtr.freezers import Mode, lifecycle
from aqtr.lora.config import base_config
from aqtr.lora.folding import Bytes, delta, dequantized
from aqtr.lora.pax import qvalue_ndim, tree_get, tree_put
from aqtr.lora.pax_op import KEY, LoraEinsum, nodes, sites
from aqtr.lora.session import (
  A_PREFIX,
  B_PREFIX,
  adapter_names,
  adapter_shapes,
)
from aqtr.pax import ops, paths
from aqtr.rules import Rule

__all__ = ['Merged', 'float_merged', 'sizes']


def _dotted(template) -> dict[int, str]:
  """{LoraEinsum index: the op's dotted Fiddle path}."""
  return {
    s.op.index: s.path
    for s in paths.find_ops(template)
    if s.op is not None and fdl.get_callable(s.op) is LoraEinsum
  }


def _pair(tree, s: WeightSite, given: bool):
  """(A, B) of `s` in `tree` (params or given adapters), shape-checked."""
  got, rank = [], s.lora.rank
  shapes = adapter_shapes(s, rank)
  for name, shape in zip(adapter_names(s), shapes, strict=True):
    where = '/'.join(map(str, (*s.op_module, name)))
    try:
      v = jnp.asarray(nn.meta.unbox(tree_get(tree, (*s.op_module, name))))
    except (KeyError, TypeError):
      raise ValueError(
        f'aqtr.lora.merge: the adapters have no {where!r}; merge adapters '
        'trained on this model (same rules).'
      ) from None
    if given and tuple(v.shape) != tuple(shape):
      raise ValueError(
        f'aqtr.lora.merge: adapter {where!r} has shape {v.shape} but the '
        f'model needs {shape} (rank {rank}); merge adapters of '
        'the same rank and shapes.'
      )
    got.append(v)
  return tuple(got)


class Merged(NamedTuple):
  """`float_merged`'s result."""

  template: Any  # Float: plain `aqtr.pax.EinsumOp`s.
  variables: dict  # With W_deq + A B alpha / r in the weights.
  rules: list  # Per merged op: its base format (None: float).
  bases: dict  # {op path: the base dequantized} (`requant.BaseGrid`).


def float_merged(template, *args, variables, adapters=None, **kwargs):
  """The adapters folded into float weights: `W_deq + A B alpha / r`.

  Args:
    template, variables: a LoRA template and its (trained) variables.
    *args, **kwargs: sample inputs.
    adapters: other adapters to fold in instead of the variables' (a
      nested dict shaped like 'params', e.g. `aqtr.lora.partition`'s).

  Returns:
    A `Merged`: the float template with plain `aqtr.pax.EinsumOp`s, its
    variables, the `Rule`s that re-quantize each merged op with its base
    format (float bases: config None), and the dequantized bases.
  """
  found = sites(template, *args, **kwargs)
  found_nodes = nodes(template)
  dotted = _dotted(template)
  params = flax.core.unfreeze(variables['params'])
  frozen = flax.core.unfreeze(variables.get(aqtr_linen.FROZEN, {}))
  rules, bases = [], {}
  for s in found:
    node = found_nodes[s.index]
    src = params if adapters is None else flax.core.unfreeze(adapters)
    a, b = _pair(src, s, adapters is not None)
    base = base_config(s.lora.base)
    if node.config is not None:
      holder = FrozenBox(
        {KEY: tree_get(frozen, s.op_module)},
        shape=s.weight.shape,
        dtype=s.weight.dtype,
        ref_ndim=qvalue_ndim(tree_get(frozen, s.op_module)),
        scale_shapes=node.scale_shapes,
      )
      w = dequantized(holder, s, base)
      bases['/'.join(map(str, s.op_module))] = w
      tree_get(frozen, s.op_module[:-1]).pop(s.op_module[-1])
    else:
      w = nn.meta.unbox(tree_get(params, s.param_path))
    w = (w + delta(s, a, b, s.lora.scale)).astype(s.weight.dtype)
    tree_put(params, s.param_path, w)
    op_params = tree_get(params, s.op_module)
    for name in adapter_names(s):
      op_params.pop(name, None)
    if not op_params:
      tree_get(params, s.module_path).pop(s.op_module[-1])
    rules.append(Rule(base, path=re.escape(dotted[s.index]), weight=True))
  out = copy.deepcopy(template)
  for node in selectors.select(out, LoraEinsum):
    fdl.update_callable(node, ops.EinsumOp, drop_invalid_args=True)
    node.config, node.mode = None, Mode.TRAIN
  fv = {
    k: v
    for k, v in flax.core.unfreeze(variables).items()
    if k != aqtr_linen.FROZEN
  }
  fv['params'] = params
  if any(jax.tree.leaves(frozen)):
    fv[aqtr_linen.FROZEN] = frozen
  return Merged(out, fv, rules, bases)


def sizes(template, *args, variables=None, **kwargs) -> Bytes:
  """Training bytes of a LoRA template vs full fine-tuning (AdamW)."""
  params = flax.core.unfreeze(variables['params'])
  frozen = variables.get(aqtr_linen.FROZEN, {})
  floats, base, base_float = set(), 0, 0
  for s in sites(template, *args, **kwargs):
    key = s.param_path
    if not is_removed(tree_get(params, key)):
      floats.add(key)
      continue
    w = s.weight
    base += lifecycle.nbytes(tree_get(frozen, s.op_module))
    base_float += math.prod(w.shape) * jnp.dtype(w.dtype).itemsize
  ad = other = 0
  for path, v in traverse_util.flatten_dict(params).items():
    if is_removed(v):
      continue
    n = lifecycle.nbytes(nn.meta.unbox(v))
    if str(path[-1]).startswith((A_PREFIX, B_PREFIX)):
      ad += n
    elif path in floats:
      base, base_float = base + n, base_float + n
    else:
      other += n
  return Bytes(ad, 2 * ad, base, other, 3 * (base_float + other), base_float)
