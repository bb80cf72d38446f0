"""One call of a model quantized by rules: each intercepted op decided.

A `Session` is the interception handler (`aqtr.flax.intercept`) of one
call of a model made by `aqtr.flax.quantize`. For each op it finds the
running module and the op's path (`'<module path>/<kind><n>'`), which
rule matches, which operand is the weight (a `WeightSite`, decided on
the jaxpr by `aqtr.flax.analysis`, never from tracers), and runs it
through the engine in the model's mode (`engine_dot`). Its weight sites
(`aqtr.flax.sites`) record what `convert` and the PTQ calibration pass
need.

Example:
  >>> swapped(lambda l, r, dn, p, e: l)  # doctest: +ELLIPSIS
  <function swapped.<locals>.run at ...>
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig
from aqtr.core.ragged_dot import (
  freeze_ragged,
  ragged_dot,
  served_ragged_dot,
)
from aqtr.flax import common, hosts, intercept, rule_state
from aqtr.flax.frozen import holder_entries, store_key
from aqtr.flax.sites import WeightSite
from aqtr.freezers import Mode, configure, lifecycle
from aqtr.rules import OpEntry, Rule

_HOW = 'Run aqtr.flax.convert(model, ...) on the trained model first.'


def engine_dot(call: lifecycle.DotCall, mode, frozen, where: str):
  """THE call into aqtr's freezers: one dot in `mode`, (out, frozen).

  Errors about an operand get the op's name (`where`) here, at the
  boundary.
  """
  r = engine_run(call, mode, frozen, where)
  return r.out, r.frozen


def engine_run(
  call, mode, frozen, where: str, initializing=False, stats=None, how=''
):
  """`engine_dot`'s `lifecycle.Result` (with new state and stats);
  `how`: how to collect missing statistics, for the message."""
  try:
    return lifecycle.run(
      call, mode, frozen=frozen, stats=stats, initializing=initializing
    )
  except lifecycle.FreezerError as e:
    raise lifecycle.in_op(e, where, how) from None


def _weight_config(config: DotGeneralConfig) -> DotGeneralConfig:
  """The op's config when its rhs is a weight: frozen by 'weights'."""
  if not config.fwd.rhs.quantized:
    return config
  return configure(config, rhs='weights')


def _served(entries: dict, config, where: str) -> dict:
  """SERVE: the op's frozen entry for `config` (a clear error otherwise)."""
  return lifecycle.find_frozen(
    entries, config, where, 'the frozen kernel', _HOW
  )


def frozen_entry(config, frozen) -> dict:
  """CONVERT: the holder's entry of one op."""
  return {lifecycle.entry_name(config): frozen}


@dataclasses.dataclass
class OpSite:
  """What a rule sees of one intercepted op (`aqtr.rules.Rule.matches`).

  Not a weight site (`aqtr.flax.sites.WeightSite`): a rule matches every
  op, with or without a weight, by where it runs (module path, layer
  classes, op kind, whether it has a weight), before any parameter is
  looked up; it holds no parameter path.
  """

  path: str
  prefixes: tuple[str, ...]
  layers: tuple[type, ...]
  op_cls: type
  kind: str
  weight: bool | None
  tags: frozenset = frozenset()


def swapped(dot):
  """`dot` with its operands swapped (the weight moved to the rhs)."""

  def run(lhs, rhs, dn, precision, preferred):
    (lc, rc), (lb, rb) = dn
    out = dot(rhs, lhs, ((rc, lc), (rb, lb)), precision, preferred)
    nb, nr = len(lb), jnp.ndim(rhs) - len(rc) - len(rb)
    nl = jnp.ndim(lhs) - len(lc) - len(lb)
    perm = (
      *range(nb),
      *range(nb + nr, nb + nr + nl),
      *range(nb, nb + nr),
    )
    return out.transpose(perm)

  return run


class Session:
  """One call of a quantized model: decides and runs each intercepted op.

  Args:
    spec: the model's rules, configs and mode.
    weights: op path -> its `WeightSite` (from `analyze`: side, parameter,
      provenance); ops absent have no weight operand.
    prefix: the path of the model called, put before the paths of its
      ops (the analysis trace runs an unbound copy of a linen module).
    observed: offered to the observers (`aqtr.ptq`'s calibration pass).
    stored: the model's op store (`aqtr.flax.frozen`).
  """

  def __init__(
    self,
    spec: Spec | None,
    weights=None,
    prefix: tuple = (),
    observed=True,
    stored=None,
  ):
    self.spec = spec
    self.weights = {} if weights is None else weights
    self.stored = {} if stored is None else stored
    self.prefix = prefix
    # Set by `convert`: op paths whose weight is frozen from the operand
    # itself (derived weights, parameters read elsewhere) into `collected`.
    self.freeze: set | None = None
    self.collected: dict = {}
    self.entries: list[OpEntry] = []
    self.uses: list[WeightSite] = []
    self.matched: list[tuple[int, ...]] = []
    self.count: dict[Any, collections.Counter] = {}
    self.alive: list[Any] = []  # keeps the ids in `count` unique
    # Set by an observer (`aqtr.ptq`'s calibration pass): called with each
    # WeightSite in TRAIN instead of the quantized dot; returns its output.
    self.tap = None
    # Set by `quantize`'s call wrapper: the model called and the call's
    # base PRNG key (`aqtr.flax.rule_state.base_key`).
    self.root = None
    self.base_key = None
    self.traced = False
    for observer in intercept.context().observers if observed else ():
      observer.append(self)

  def _op_id(self, module, mpath: tuple, kind: str) -> str:
    """'<kind><n>': the n-th op of `kind` run at module path `mpath` in
    this call (a module called twice runs ops 0 and 1). A linen lifted
    transform that traces its body again (`nn.scan`) makes new scope
    trees: the count restarts there, so a re-trace names its ops alike."""
    key = mpath
    root = hosts.scope_root(module)
    if root is not None:
      self.alive.append(root)
      key = (mpath, id(root))
    counter = self.count.setdefault(key, collections.Counter())
    n = counter[kind]
    counter[kind] += 1
    return f'{kind}{n}'

  def locate(self, op, stack):
    """(module, module path, op id, op path) of `op` run by `stack[0]`."""
    module = stack[0] if stack else None
    mpath = self.prefix + hosts.path_in_stack(stack)
    text = '/'.join(map(str, mpath))
    op_id = self._op_id(module, mpath, op.kind)
    return module, mpath, op_id, f'{text}/{op_id}' if text else op_id

  def __call__(self, op: intercept.OpCall):
    stack = intercept.modules()
    module, mpath, op_id, where = self.locate(op, stack)
    text = '/'.join(map(str, mpath))
    params = hosts.own_params(module) if module is not None else {}
    side, weight, frozen = self._weight(op, op_id, where, params)
    site = OpSite(
      text,
      tuple('/'.join(map(str, mpath[:i])) for i in range(1, len(mpath))),
      tuple(type(m) for m in stack),
      type(module),
      op.kind,
      side is not None,
    )
    matched = tuple(
      i for i, rule in enumerate(self.spec.rules) if rule.matches(site)
    )
    chosen = matched[0] if matched else None
    config = None if chosen is None else self.spec.configs[chosen]
    self.matched.append(matched)
    quantize = not common.is_float(config) and op.why == ''
    name = op.name if op.why == '' else f'{op.name} ({op.why}: float)'
    self.entries.append(
      OpEntry(
        where,
        name,
        config if quantize else None,
        chosen,
        op.kind,
        side,
        op.shapes(),
      )
    )
    if not quantize:
      return op.float()
    label = f'{where} ({op.name} of shapes {op.shapes()})'
    try:
      origin = (op_id, where, weight)
      host = rule_state.RuleHost(
        module, op_id, label, config, self.spec.mode, mpath, self.traced
      )
      return self._run(op, config, side, frozen, origin, label, host)
    except (ValueError, TypeError) as e:
      if str(e).startswith(where):
        raise
      raise type(e)(f'{label}: {e}') from e

  def _weight(self, op, op_id, where, params):
    """(weight side, its `WeightSite` or None, frozen entries) of the op."""
    for value in params.values():
      entries = holder_entries(value) or {}
      for side in ('lhs', 'rhs'):
        if f'{op_id}_{side}' in entries:
          return side, None, entries[f'{op_id}_{side}']
    w = self.weights.get(where)
    entries = self.stored.get(store_key(where)) or {}
    for side in ('lhs', 'rhs'):
      if f'{op_id}_{side}' in entries:
        return side, w, entries[f'{op_id}_{side}']
    if w is None or (op.kind in ('conv', 'ragged_dot') and w.side != 'rhs'):
      return None, None, None
    return w.side, w, None

  def key_of(self, config, mode, where: str, label: str, initializing=False):
    """The PRNG key of the op at `where` (None when it needs none)."""
    use = rule_state.key_need(config, mode)
    if use is None:
      return None
    if self.base_key is not None:
      return rule_state.op_key(self.base_key, where)
    if use == 'dummy' or initializing:
      return jax.random.key(0)
    raise ValueError(
      f'{label}: the config rounds stochastically (or draws a random '
      'transform) and needs a PRNG key, but the call has none: '
      f'{rule_state.missing_key(self.root, self.spec.rng_stream)}'
    )

  def _run(self, op, config, side, frozen, origin, label, host):
    """The op in the session's mode; `origin`: (op id, op path, the
    analysis's WeightSite or None)."""
    op_id, where, weight = origin
    param = None if weight is None else '/'.join(map(str, weight.param_path))
    mode = self.spec.mode
    ragged = op.kind == 'ragged_dot'
    # A ragged_dot with state or static ranges runs the freezers' life
    # cycle like a dot (its group sizes in the DotCall: per-expert scales);
    # a stateless one keeps its own stored form (`freeze_ragged`).
    cycled = ragged and rule_state.keeps(config)
    if side is not None and (cycled or not ragged):
      config = _weight_config(config)
    collect = self.freeze is not None and where in self.freeze
    if collect and side is not None and config.fwd.rhs.quantized:
      mode = Mode.CONVERT
    elif mode is Mode.SERVE and frozen is not None:
      frozen = _served(frozen, config, label)
      if ragged and not cycled:
        key = self.key_of(config, mode, where, label, host.initializing)
        return _ragged_served(op, frozen['ragged'], config, key)
    elif mode is Mode.SERVE and side is not None and config.fwd.rhs.quantized:
      if self.spec.converted:
        mode = Mode.TRAIN  # kept float by convert(keep=...): on the fly
      else:
        raise ValueError(
          f'{label}: mode SERVE reads frozen weights but the model holds '
          f'float parameter {param!r}. {_HOW}'
        )
    elif frozen is not None:
      raise ValueError(
        f'{label}: parameter {param!r} holds frozen serving values; mode '
        f'{mode.name} needs the float parameter. Train the quantized float '
        'model (aqtr.flax.quantize), serve the converted one.'
      )
    elif mode is not Mode.CALIBRATE:
      mode = Mode.TRAIN

    def dot(lhs, rhs, dn, precision, preferred):
      key = self.key_of(config, mode, where, label, host.initializing)
      state = None
      if rule_state.needs_state(config):
        init = common.CalibStateInit(lhs, rhs, dn, config)
        state = host.calib_state(init)
      sizes = op.extra['group_sizes'] if ragged else None
      # The op's output sharding (explicit mesh axes), unless the operands
      # were swapped (its axes permuted).
      out_sharding = op.extra.get('out_sharding') if side != 'lhs' else None
      call = lifecycle.DotCall(
        lhs,
        rhs,
        dn,
        config,
        key,
        precision,
        preferred,
        state,
        sizes,
        out_sharding,
      )
      stats, run_mode = None, mode
      if mode is not Mode.SERVE and not host.initializing:
        stats = host.stats(mode) if lifecycle.freezers(config) else None
      if mode is Mode.TRAIN and stats and rule_state.collects(config):
        # After CALIBRATE, TRAIN uses the static ranges as SERVE will.
        run_mode = Mode.CONVERT
        call = call.replace(config=rule_state.static_config(config))
      r = engine_run(
        call,
        run_mode,
        frozen,
        label,
        host.initializing,
        stats,
        host.how_calibrate,
      )
      host.store(r)
      out, fr = r.out, r.frozen
      if mode is Mode.CONVERT:
        self.collected[where] = {f'{op_id}_{side}': frozen_entry(config, fr)}
      return out

    run = swapped(dot) if side == 'lhs' else dot
    if ragged and not cycled and mode is Mode.CONVERT:
      parts = freeze_ragged(op.extra['rhs'], config)
      entry = frozen_entry(config, {'ragged': parts})
      self.collected[where] = {f'{op_id}_{side}': entry}
      mode = Mode.TRAIN
    if weight is not None and mode is Mode.TRAIN and config.fwd.rhs.quantized:
      w = getattr(op, side)
      other = op.rhs if side == 'lhs' else op.lhs
      use = dataclasses.replace(
        weight,
        op_path=where,
        op_id=op_id,
        op_module=host.mpath,
        kind=op.kind,
        config=config,
        weight=jax.ShapeDtypeStruct(jnp.shape(w), jnp.result_type(w)),
        other=jax.ShapeDtypeStruct(jnp.shape(other), jnp.result_type(other)),
        state_at=(host.mpath, op_id) if rule_state.keeps(config) else None,
        op=op,
      )
      self.uses.append(use)
      if self.tap is not None and not ragged:
        return self.tap(use)
    if ragged and not cycled:
      key = self.key_of(config, mode, where, label, host.initializing)
      return _ragged(op, config, key)
    return op.run(run, op.lhs, op.rhs)


def _ragged_served(op, frozen, config, key=None):
  a = op.extra
  out = served_ragged_dot(
    a['lhs'],
    frozen,
    a['group_sizes'],
    config,
    key=key,
    precision=a['precision'],
    preferred_element_type=a['preferred_element_type'],
  )
  return common.constrain(out, a['out_sharding'])


def _ragged(op, config, key=None):
  a = op.extra
  return ragged_dot(
    a['lhs'],
    a['rhs'],
    a['group_sizes'],
    config,
    key=key,
    precision=a['precision'],
    preferred_element_type=a['preferred_element_type'],
    out_sharding=a['out_sharding'],
  )


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a quantized model class carries: rules, built configs, mode."""

  rules: tuple[Rule, ...]
  configs: tuple[Any, ...]
  mode: Mode
  methods: tuple[str, ...] = ('__call__',)
  converted: bool = False
  rng_stream: str = rule_state.STREAM


__all__ = [
  'OpSite',
  'Session',
  'Spec',
  'engine_dot',
  'engine_run',
  'frozen_entry',
  'swapped',
]
