"""The host protocol (`aqtr.flax.host`) for Pax-style templates.

A Pax model is a Fiddle template of `aqtr.pax` layers (its weight ops
injected by `aqtr.pax.inject`) plus its variables. The template is built
once into a linen module, which a `LinenHost` runs, traces and reads;
parameter paths start with 'params' as in the variables; `result()` is
(template, variables). Importing `aqtr.pax` registers this host with
`aqtr.flax.hosts.of`.

Example:
  >>> import fiddle as fdl, jax, jax.numpy as jnp, aqtr.pax
  >>> from aqtr.flax import hosts
  >>> t = fdl.Config(aqtr.pax.Linear, features=2)
  >>> v = fdl.build(t).init(jax.random.key(0), jnp.ones((1, 4)))
  >>> h = hosts.of(t, v)
  >>> h.run_jit((jnp.ones((1, 4)),), {}).shape
  (1, 2)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import fiddle as fdl
import flax
from fiddle import selectors

import aqtr.flax.linen as aqtr_linen
from aqtr import fiddle as aqtr_fiddle
from aqtr import freezers, sparsity
from aqtr.core.config import DotGeneralConfig
from aqtr.flax import common, host, hosts
from aqtr.flax.host_linen import LinenHost
from aqtr.freezers import Mode
from aqtr.pax.ops import EinsumOp

__all__ = ['TemplateHost', 'frozen_config', 'is_template', 'serving_template']


def frozen_config(config: Any) -> DotGeneralConfig | None:
  """The op's config with its weight (rhs) frozen for serving: the
  'weights' freezer ('sparse_weights' for N:M sparse weights, stored
  compressed); None when the op does not quantize its weight."""
  if isinstance(config, fdl.Buildable):
    config = aqtr_fiddle.build(config)
  if not isinstance(config, DotGeneralConfig) or not config.fwd.rhs.quantized:
    return None
  nm = isinstance(config.fwd.rhs.sparsity, sparsity.NM)
  return freezers.configure(config, rhs='sparse_weights' if nm else 'weights')


def serving_template(injected: fdl.Config, mode: Mode) -> fdl.Config:
  """The injected template with its weight ops in a freezer `mode`.

  Every `EinsumOp` whose config quantizes its weight becomes
  `aqtr.flax.linen.Einsum` with `frozen_config(config)` in `mode`
  (CONVERT freezes, SERVE runs from the frozen values); the other ops and
  the parameter tree are unchanged; `injected` is not modified.
  """
  cfg = copy.deepcopy(injected)
  for node in selectors.select(cfg, EinsumOp):
    frozen = frozen_config(node.__arguments__.get('config'))
    if frozen is None:
      continue
    stream = node.__arguments__.get('rng_stream', 'quant')
    fdl.update_callable(node, aqtr_linen.Einsum, drop_invalid_args=True)
    node.config, node.mode, node.rng_name = frozen, mode, stream
  return cfg


def is_template(model: Any) -> bool:
  """Whether `model` is a Fiddle template (a Pax model to build)."""
  return isinstance(model, fdl.Buildable)


class TemplateHost(host.Host):
  """A Pax template and its variables (see `aqtr.flax.host.Host`)."""

  by_injection = True

  @functools.cached_property
  def built(self) -> LinenHost:
    """The linen host of the built template."""
    return LinenHost(fdl.build(self.model), self.variables)

  def call_fn(self, args, kwargs, method='__call__'):
    return self.built.call_fn(args, kwargs, method)

  def trace_params(self, raw, args, kwargs):
    return self.built.trace_params(raw, args, kwargs)

  def signature(self, raw, args, kwargs):
    return self.built.signature(raw, args, kwargs)

  def params(self) -> dict[tuple, Any]:
    return self.built.params()

  def with_params(self, params: Mapping[tuple, Any]) -> TemplateHost:
    return TemplateHost(self.model, self.built.with_params(params).variables)

  def holders(self):
    return self.built.holders()

  def clone(self) -> fdl.Buildable:
    return copy.deepcopy(self.model)

  def leaf(self, path):
    return self.built.leaf(path)

  def set_leaf(self, path, value) -> None:
    self.built.set_leaf(path, value)
    self.variables = self.built.variables

  def leaves(self):
    return self.built.leaves()

  def remove_param(self, path) -> None:
    self.built.remove_param(path)
    self.variables = self.built.variables

  def add_param(self, path, value, variable_type) -> None:
    self.built.add_param(path, value, variable_type)
    self.variables = self.built.variables

  def set_holder(self, path, entries) -> None:
    self.built.set_holder(path, entries)
    self.variables = self.built.variables

  def param_tree(self) -> dict:
    return self.built.param_tree()

  def with_param_tree(self, tree) -> TemplateHost:
    return TemplateHost(self.model, dict(tree))

  def tree_path(self, path) -> tuple:
    return self.built.tree_path(path)

  def freeze_ops(self, args, kwargs) -> TemplateHost:
    """The served template: its weight ops frozen (CONVERT of the serving
    template, `aqtr.flax.linen.convert`), run by the SERVE template."""
    conv = fdl.build(serving_template(self.model, Mode.CONVERT))
    out = aqtr_linen.convert(conv, self.variables, *args, **kwargs)
    served = serving_template(self.model, Mode.SERVE)
    return TemplateHost(served, flax.core.unfreeze(out))

  def ops_in_mode(self, mode):
    """A copy of the template whose injected ops run in `mode`."""
    common.check_mode(mode)
    cfg = copy.deepcopy(self.model)
    for node in selectors.select(cfg, EinsumOp):
      node.mode = mode
    return cfg

  def put_frozen(self, op_path: str, holder: tuple, entry: str, parts):
    """Replaces the stored rhs parts of one frozen op (in place)."""
    del holder  # Pax ops keep their frozen values by op path
    node = self.variables[common.FROZEN]
    for k in op_path.split('/'):
      node = node[k]
    node[entry]['rhs'] = parts

  def with_frozen(self, holders, ops) -> TemplateHost:
    done = self.built.with_frozen(holders, ops)
    return TemplateHost(self.model, done.variables)

  def stored_ops(self) -> dict:
    return self.built.stored_ops()

  def frozen_weights(self):
    return self.built.frozen_weights()

  def module_store(self, mpath, name):
    return self.built.module_store(mpath, name)

  def state(self):
    return self.built.state()

  def result(self):
    return self.model, self.variables


hosts.register(is_template, TemplateHost, 'a Pax template')
