"""What a rule's op needs beyond its operands: PRNG keys and state.

Models quantized by rules (`aqtr.flax.quantize`) run the whole catalogue:

- Keys (stochastic rounding, random transforms): one base key per model
  call, from an explicit `aqtr_key=` argument of the call, else the
  model's rng stream (`rng_stream`, 'aqtr' by default: nnx `Rngs` held by
  the model, e.g. `quantize(model, rules, rngs=nnx.Rngs(aqtr=0))`; linen
  `apply(..., rngs={'aqtr': key})`). Each op folds its path into it: keys
  differ across ops and (as the stream advances or the caller passes a
  new key) across steps, and repeat for a seed. The ops of a scanned
  layer stack share one path, so they share a key.
- State (stateful calibrations: delayed scaling, EMA statistics, mean
  absmax; sparsity schedules): the stats of each op live in the module
  that runs it, as `aqtr.state` trees keyed by op id: nnx
  `QuantState` variable `aqtr_state` ({op id: {operand path: stats}}),
  linen collection 'aqtr_state' (one variable per op id). Learned
  parameters (LSQ steps, PACT clips) are params named 'aqtr_learned'
  ({op id: {operand path: {name: value}}}) that the optimizer trains.
  TRAIN and CALIBRATE write the forward stats as new values (nnx: in the
  call, as BatchNorm's statistics; linen: `mutable=['aqtr_state']`); the
  backward passes' stats come back as the gradient w.r.t. the state
  (`aqtr.flax.nnx.update_state`, `aqtr.state.merge_tree`).

Example:
  >>> import jax.numpy as jnp, aqtr
  >>> op_key(jnp.zeros((), jnp.uint32), 'a/dot_general0').dtype
  key<fry>
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.core import slot_state
from aqtr.flax import common, hosts, kinds
from aqtr.flax.nnx import CalibState, Stats
from aqtr.freezers import Mode, configure, lifecycle

STATE = common.STATE  # nnx attribute / linen collection
STATS = common.STATS  # CALIBRATE's statistics: nnx attribute / collection
LEARNED = common.LEARNED  # param name
STREAM = 'aqtr'  # the default rng stream

__all__ = [
  'LEARNED',
  'STATE',
  'STREAM',
  'STATS',
  'QuantState',
  'RuleHost',
  'base_key',
  'collects',
  'keeps',
  'kept',
  'key_need',
  'op_key',
  'read',
  'read_stats',
  'static_config',
  'traced',
]


class QuantState(CalibState):
  """The calibration state of the rule ops one nnx module runs.

  Value: {op id: {operand path: stats}}. A `CalibState`:
  `aqtr.flax.nnx.update_state` takes the backward passes' stats from the
  gradient w.r.t. it.
  """


def key_need(config, mode: Mode) -> str | None:
  """'required', 'dummy' (any key will do) or None, for one op's config."""
  if common.is_float(config):
    return None
  use = lifecycle.key_use(config, mode)
  if use is None and config.needs_key:
    use = 'required' if mode is Mode.TRAIN else 'dummy'
  return use


def _typed(key):
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  if key.ndim == 0:
    return jax.random.key(key)
  return jax.random.wrap_key_data(key)


def _nnx_stream(model, stream: str):
  """The model's nnx rng stream named `stream`, or None."""
  for _, m in nnx.iter_modules(model):
    for v in vars(m).values():
      if isinstance(v, nnx.Rngs) and stream in v:
        return v[stream]
      if isinstance(v, nnx.RngStream) and v.tag == stream:
        return v
  return None


def base_key(model, spec, explicit):
  """The base key of one call: `explicit`, else drawn from the stream.

  Drawn only when some config of `spec` needs a key in its mode (the
  stream advances once per call). None: no key (an op that needs one
  raises, naming the fix).
  """
  if explicit is not None:
    return _typed(explicit)
  if not any(key_need(c, spec.mode) == 'required' for c in spec.configs):
    return None
  stream = spec.rng_stream
  if kinds.is_linen(model):
    if model.scope is not None and model.has_rng(stream):
      return model.make_rng(stream)
    return None
  found = _nnx_stream(model, stream)
  return None if found is None else found()


def op_key(base, where: str):
  """The key of the op at path `where`: `base` with the path folded in."""
  return jax.random.fold_in(_typed(base), zlib.crc32(where.encode()) // 2)


def missing_key(model, stream: str) -> str:
  """How to give a model's ops keys (the end of an error message)."""
  if kinds.is_linen(model):
    return (
      f"pass rngs={{'{stream}': key}} to apply (or aqtr_key=key to the call)."
    )
  return (
    f'give the model an rng stream {stream!r}: aqtr.flax.quantize(model, '
    f'rules, rngs=nnx.Rngs({stream}=seed)) (or pass aqtr_key=key to the '
    'call).'
  )


def traced(model) -> bool:
  """Whether an nnx model's parameters are tracers (a call under jit or
  grad): parameters created then never reach an optimizer built before."""
  if kinds.is_linen(model):
    return False
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return bool(leaves) and isinstance(leaves[0], jax.core.Tracer)


def _shapes(tree):
  return jax.tree.map(lambda a: (tuple(jnp.shape(a)), str(a.dtype)), tree)


class RuleHost(common.OpHost):
  """The state of one rule op, kept in the module that runs it.

  Args:
    module: the running module (a bound linen Module or an nnx Module).
    op_id: the op's id in the module ('dot_general0').
    where: the op's path and shapes, for messages.
    config, mode: the op's.
    mpath: the module's path in the model called.
    traced: the model's call runs under a transform (`traced`).
  """

  frozen_collection = 'the op store'
  how_convert = 'Run aqtr.flax.convert(model, ...) on the trained model.'
  how_calibrate = (
    'Run aqtr.flax.calibrate(model, batches) on the quantized model first.'
  )

  def __init__(
    self,
    module,
    op_id: str,
    where: str,
    config,
    mode: Mode,
    mpath=(),
    traced=False,
  ):
    self.module, self.op_id, self.where = module, op_id, where
    self.mpath = tuple(mpath)
    self.traced = traced
    self.config, self.mode = config, mode
    self.linen = kinds.is_linen(module)

  @property
  def initializing(self) -> bool:
    return self.linen and self.module.is_initializing()

  def _check(self, got, make, what: str):
    want = _shapes(jax.eval_shape(make))
    if _shapes(got) != want:
      raise ValueError(
        f'{self.where}: the {what} held for this op does not fit it (got '
        f'{_shapes(got)}, the op needs {want}): state of another model or '
        'shape; initialise the state of this model (init / a first call).'
      )

  def calib_state(self, make) -> dict:
    """The op's engine state tree, created on first use."""
    if self.module is None:
      raise ValueError(
        f'{self.where}: a stateful calibration runs outside any Flax '
        'module; its state has no home. Call the op from a module.'
      )
    if self.linen:
      stats, learned = self._linen(make)
    else:
      stats, learned = self._nnx(make)
    return common.assemble(stats, learned)

  def _nnx(self, make):
    m, op = self.module, self.op_id
    var = getattr(m, STATE, None)
    have = {} if var is None else var.get_value()
    lvar = getattr(m, LEARNED, None)
    if op not in have:
      if make.learns and self.traced:
        raise ValueError(
          f'{self.where}: the learned calibration parameters (LSQ, PACT) '
          'would be created inside a transform, where the optimizer '
          'cannot see them; call the quantized model once on a sample '
          'batch (outside jit / grad) before building the optimizer.'
        )
      stats, learned = make()
      if var is None:
        setattr(m, STATE, QuantState({op: stats}))
      else:
        var.set_value({**have, op: stats})
      if learned:
        old = {} if lvar is None else lvar.get_value()
        if lvar is None:
          setattr(m, LEARNED, nnx.Param({op: learned}))
        else:
          lvar.set_value({**old, op: learned})
      return stats, learned
    stats = have[op]
    self._check(stats, lambda: make()[0], f'{STATE} stats')
    learned = {}
    if make.learns:
      got = {} if lvar is None else lvar.get_value()
      if op not in got:
        raise ValueError(
          f'{self.where}: the learned parameter {LEARNED}[{op!r}] is '
          'missing: the optimizer cannot see it; keep the params the '
          'first call created.'
        )
      learned = got[op]
    return stats, learned

  def _linen(self, make):
    scope, op = self.module.scope, self.op_id
    if scope.has_variable(STATE, op):
      stats = scope.get_variable(STATE, op)
      self._check(stats, lambda: make()[0], f'{STATE!r} stats')
    elif not jax.tree.leaves(jax.eval_shape(lambda: make()[0])):
      stats = make()[0]  # Only learned parameters: no stats to keep.
    elif scope.is_mutable_collection(STATE):
      stats = make()[0]
      scope.put_variable(STATE, op, stats)
    elif self.initializing:
      raise ValueError(
        f'{self.where}: the config keeps calibration state in the '
        f'collection {STATE!r}, which a linen transform around this module '
        '(nn.scan / nn.vmap) does not carry: add it to the transform, e.g. '
        f"variable_axes={{'params': 0, {STATE!r}: 0}}."
      )
    else:
      raise ValueError(
        f'{self.where}: the config has stateful calibrations; their state '
        f'lives in the collection {STATE!r}: init the quantized model and '
        f"pass its variables to apply (mutable=['{STATE}'] in TRAIN)."
      )
    learned = {}
    if make.learns:
      have = (
        dict(scope.get_variable('params', LEARNED))
        if scope.has_variable('params', LEARNED)
        else {}
      )
      if op in have:
        learned = have[op]
      elif self.initializing:
        learned = make()[1]
        scope.put_variable('params', LEARNED, {**have, op: learned})
      else:
        raise ValueError(
          f'{self.where}: the learned parameter params/.../{LEARNED}/{op} '
          'is missing, so the optimizer cannot see it: init the quantized '
          'model (not the float one) and train all of its params.'
        )
    return stats, learned

  def stats(self, mode: Mode):
    """CALIBRATE / CONVERT: the op's {side: statistics} (or None)."""
    del mode
    if self.module is None:
      return None
    if self.linen:
      scope = self.module.scope
      if scope.has_variable(STATS, self.op_id):
        return scope.get_variable(STATS, self.op_id)
      return None
    var = getattr(self.module, STATS, None)
    return None if var is None else var.get_value().get(self.op_id)

  def _store_stats(self, stats) -> None:
    if self.module is None or self.initializing:
      return
    if self.linen:
      scope = self.module.scope
      if not scope.is_mutable_collection(STATS):
        raise ValueError(
          f'{self.where}: CALIBRATE records static ranges in the collection '
          f'{STATS!r}: use aqtr.flax.calibrate (or apply with mutable='
          f"['{STATS}'])."
        )
      scope.put_variable(STATS, self.op_id, stats)
      return
    var = getattr(self.module, STATS, None)
    if var is None:
      setattr(self.module, STATS, Stats({self.op_id: stats}))
    else:
      var.set_value({**var.get_value(), self.op_id: stats})

  def store(self, result) -> None:
    """Writes the op's new forward stats (TRAIN, CALIBRATE) and its
    CALIBRATE statistics."""
    if result.stats:
      self._store_stats(result.stats)
    if result.state is None or self.initializing:
      return
    if self.mode not in (Mode.TRAIN, Mode.CALIBRATE):
      return
    stats = common.stats_of(result.state)
    if not jax.tree.leaves(stats):
      return
    if self.linen:
      scope = self.module.scope
      if not scope.is_mutable_collection(STATE):
        raise ValueError(
          f'{self.where}: {self.mode.name} updates the calibration state in '
          f"the collection {STATE!r}: apply with mutable=['{STATE}'] (and "
          "merge the backward passes' state with aqtr.state.merge_tree)."
        )
      scope.put_variable(STATE, self.op_id, stats)
      return
    var = getattr(self.module, STATE)
    var.set_value({**var.get_value(), self.op_id: stats})


def collects(config) -> bool:
  """Whether an op's config freezes a side from CALIBRATE statistics."""
  if common.is_float(config):
    return False
  return any(f.collects for f in lifecycle.freezers(config).values())


def static_config(config):
  """`config` with only its collecting freezers: TRAIN after CALIBRATE
  runs it in CONVERT (the static bounds from the statistics; the other
  sides quantized on the fly, as the 'weights' freezer would freeze them).
  """
  off = {
    side: 'none'
    for side, f in lifecycle.freezers(config).items()
    if not f.collects
  }
  return configure(config, **off) if off else config


def keeps(config) -> bool:
  """Whether convert needs the op's state or statistics."""
  return needs_state(config) or collects(config)


def needs_state(config) -> bool:
  """Whether an op's config keeps state (calibrations or schedules)."""
  return not common.is_float(config) and bool(slot_state.paths(config))


def read(model, variables, at: tuple, what: str) -> dict:
  """The engine state tree of one op of a quantized model, concretely.

  Args:
    model: the quantized model (nnx: it holds the state).
    variables: linen: the model's variables (nnx: unused).
    at: (module path, op id) (`WeightSite.state_at`).
    what: the op's path, for the message.

  Returns:
    {operand path: {'stats': ..., 'learned': ...}}.
  """
  mpath, op = at
  host = hosts.of(model, variables, who=what)
  stats = _get(host.module_store(mpath, STATE), op)
  learned = _get(host.module_store(mpath, LEARNED), op) or {}
  if stats is None and learned:
    stats = {p: {} for p in learned}  # Learned only: no stats kept.
  if stats is None:
    raise ValueError(
      f'{what}: the op keeps calibration state, but the model holds none for '
      'it: train the quantized model (or call it once: init / a first '
      'call) before aqtr.flax.convert.'
    )
  return common.assemble(stats, learned)


def _get(store, op):
  """`store[op]`, or None when the store (a dict) has none."""
  return store.get(op) if hasattr(store, 'get') else None


def read_stats(model, variables, at: tuple, what: str) -> dict:
  """The CALIBRATE statistics ({side: stats}) of one op, concretely.

  Raises one line naming `what` (the op) when CALIBRATE never ran for it.
  """
  mpath, op = at
  got = _get(
    hosts.of(model, variables, who=what).module_store(mpath, STATS), op
  )
  if got is None or not all(
    bool(jnp.all(jnp.asarray(v['count']) > 0)) for v in got.values()
  ):
    raise ValueError(
      f"{what}: the config freezes static ranges (the 'calibration' "
      'freezer) from CALIBRATE statistics, but CALIBRATE never ran for this '
      'op: run aqtr.flax.calibrate(model, batches) on the quantized model '
      'before aqtr.flax.convert.'
    )
  return got


def kept(model, variables, use) -> dict:
  """What convert needs of a weight op besides the weight (concretely):
  {'state': its calibration state, 'stats': its CALIBRATE statistics},
  each None when the op's config has no use for it."""
  if key_need(use.config, Mode.CONVERT) == 'required':
    raise ValueError(
      f'{use.op_path}: the config rounds the forward pass stochastically, '
      'which no frozen weight can reproduce: serve with a round-to-nearest '
      'forward config (stochastic rounding on the gradients only).'
    )
  state = stats = None
  if needs_state(use.config):
    state = read(model, variables, use.state_at, use.op_path)
  if collects(use.config):
    stats = read_stats(model, variables, use.state_at, use.op_path)
  return {'state': state, 'stats': stats}
