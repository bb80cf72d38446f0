"""Quantized `dot_general`: the custom VJPs of aqtr (and `fenced_cotangent`).

Math. Operands are brought to canonical 3-D layouts (`dimension_numbers.py`):
L [B, M, K], R [B, N, K] or [B, K, N]. With per-group scales constant along K
(within a tile j) the forward factorises:

  out[b, m, n] = sum_j (q_L[b, j, m, :] . q_R[b, j, n, :]) s_L[b,j,m] s_R[b,j,n]

and runs the real int8 x int8 -> int32 (fp8 x fp8 -> f32) dot. With
cotangent g in the output layout [B, M, N]:

  dlhs:  dL = g . Y_R     (contract N)      drhs:  dR = g^T . Y_L  (contract M)

where Y is the float operand or, when reusing the forward quantization
(`use_fwd_quant`), the forward QTensor whose scale is folded into g first:
(g * s_R) . q_R == g . dequant(R). Each of these dots is quantized by
`config.dlhs` / `config.drhs` (the gradient g is their lhs operand).
Gradients pass straight through the rounding, masked by the forward
numerics' clip_gradient; no gradient reaches the scales, except through a
learned calibration (LSQ, PACT), whose own rule replaces the straight
through one.

Geometry (`core.geometry`): the same VJP runs `aqtr.ragged_dot`, whose
plan groups the rows of lhs by `group_sizes` (an argument of the VJP,
None for dot_general) against one rhs matrix per group.

State (`aqtr.core.slot_state`): with `state=`, the call returns
(out, new_state); the state is a differentiable input of this VJP, whose
cotangent carries the backward operands' new state and the learned
parameters' gradients.

Layout: on XLA:CPU an integer dot is fast only when its lhs contracts its
last axis (MK.KN, MK.NK). The forward dot is MK.NK or MK.KN, dlhs is MK.KN
or MK.NK, and drhs emits dR directly in the weight's layout: [N, K] weights
get q_g^T[N, M] . q_L[M, K]; [K, N] weights get q_L^T[K, M] . q_g[M, N],
with q_L^T written by the forward pass. A transposed operand is quantized
as it lies and its int8 values copied transposed (`passes.qdot`,
`QuantizedOperand.with_transposed`): XLA:CPU quantizes a transposed float
array several times slower. That is the form lowered for CPU; lowered for
GPU, every low-precision dot has both operands contracting their minor
axis, with no fence or barrier before it (`core.lowering`: one traced
function holds both forms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from aqtr.core import prims, slot_state
from aqtr.core.backward import backward
from aqtr.core.boundary import cotangent_boundary
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import Broadcast
from aqtr.core.forward import forward
from aqtr.core.plan import Plan
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.rounding import as_typed_key
from aqtr.core.sharding import (
  check_dot_out_sharding,
  check_operands,
  run_on_mesh,
)


# The primal, the forward with residuals and the backward are jitted one
# by one (each traced once per plan and operand types, and reused by every
# equal dot), under a custom VJP that is not: a jitted custom VJP is traced
# as its primal, then that jaxpr is linearized, which traces the forward
# again (twice the tracing of a differentiated dot).
@functools.partial(jax.jit, static_argnums=(5,))
def _primal(lhs, rhs, key, state, groups, plan: Plan):
  return forward(plan, lhs, rhs, key, state, False, groups)[0]


@functools.partial(jax.jit, static_argnums=(5,))
def _fwd(lhs, rhs, key, state, groups, plan: Plan):
  return forward(plan, lhs, rhs, key, state, groups=groups)


@functools.partial(jax.jit, static_argnums=(0,))
def _bwd(plan: Plan, res, gs):
  # The new state's cotangent is unused; group sizes get none.
  return (*backward(plan, res, gs[0]), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _qdot(lhs, rhs, key, state, groups, plan: Plan):
  return _primal(lhs, rhs, key, state, groups, plan)


_qdot.defvjp(_fwd, _bwd)


@jax.custom_vjp
def fenced_cotangent(x: jax.Array) -> jax.Array:
  """`x`, whose cotangent is written to a buffer of its own on the way back.

  The identity forward; backward, the cotangent passes through
  `boundary.cotangent_boundary` (a fence on CPU, no mesh, an unsharded
  cotangent), so no fusion after it recomputes the elementwise chain that
  made it. For a float product whose gradient contracts the
  tokens (LoRA's B): XLA:CPU copies that cotangent transposed and would
  fuse the whole chain (e.g. a GELU's backward) into the copy, with
  strided loads. Values are unchanged, bit for bit; derivatives of any
  order are those of the identity.

  Example:
    >>> x = jnp.arange(3.0)
    >>> jax.grad(lambda x: (fenced_cotangent(x) ** 2).sum())(x).tolist()
    [0.0, 2.0, 4.0]
  """
  return x


def _fence_fwd(x):
  return x, None


@jax.custom_jvp
def _fence(g):
  return cotangent_boundary(g)


@_fence.defjvp
def _fence_jvp(primals, tangents):
  # The fence is the identity: so is its derivative (a gradient of this
  # gradient, any order, differentiates no fence).
  return _fence(primals[0]), tangents[0]


def _fence_bwd(_, g):
  return (_fence(g),)


fenced_cotangent.defvjp(_fence_fwd, _fence_bwd)
# (lhs, rhs, key, typed state, group sizes, plan) -> (out, new typed
# state); group sizes: a ragged plan's (`aqtr.ragged_dot`), else None.
quantized_dot = _qdot
# Its jitted parts (for tests of their trace caches).
JITTED = (_primal, _fwd, _bwd)


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  config: DotGeneralConfig | None = None,
  *,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
  state: dict | None = None,
):
  """Drop-in for `jax.lax.dot_general` quantized as `config` says.

  On a mesh (auto/explicit axes, `jax.shard_map`) it computes what it
  computes on one device, with lax's output sharding (`core.sharding`).

  Args:
    lhs, rhs: float operands; either may instead be a QTensor made by
      `quantize_operand` with the same config and dimension numbers (serving
      frozen weights: no float copy needed; no gradient reaches it).
    dimension_numbers: ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)).
    config: a DotGeneralConfig; None (or an all-float config) is exactly
      `lax.dot_general`, values and gradients.
    key: PRNG key (typed or raw uint32[2]); required by stochastic rounding.
    precision, preferred_element_type: as in `lax.dot_general`; precision
      applies to the float dots.
    out_sharding: as in `lax.dot_general` (a NamedSharding or
      PartitionSpec of the output); under auto axes a sharding constraint.
    state: the calibration state tree (`aqtr.state.init`) when the config
      has stateful or learned calibrations; see `aqtr.core.slot_state`.

  Returns:
    [batch..., lhs free..., rhs free...] in `preferred_element_type` or the
    operands' result type; with `state`, the pair (out, new_state).

  Example:
    >>> import jax, jax.numpy as jnp, aqtr
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    >>> aqtr.dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                  aqtr.presets.int8()).tolist()[0]
    [8.0, 8.0]
  """
  if config is not None and not isinstance(config, DotGeneralConfig):
    raise TypeError(
      f'config must be an aqtr.DotGeneralConfig or None, got {config!r}.'
    )
  key = as_typed_key(key)  # Checked even where unused.
  # Size-1 batch axes broadcast (float operands; a stored QTensor's layout
  # is fixed at freezing).
  plain = not any(isinstance(x, QTensor) for x in (lhs, rhs))
  bc = plain and Broadcast.of(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
  if bc:
    return _broadcasting(
      lhs,
      rhs,
      bc,
      config,
      key=key,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
      state=state,
    )
  check_dot_out_sharding(out_sharding, lhs, rhs, dimension_numbers)
  stored = tuple(isinstance(x, QTensor) for x in (lhs, rhs))
  slot_state.check_tree(config, state, stored)
  if any(stored) and config is None:
    raise ValueError(
      'a QTensor operand needs the config it was quantized with: pass '
      'config=...'
    )
  empty = any(
    not isinstance(x, QTensor) and jnp.size(x) == 0 for x in (lhs, rhs)
  )
  # Zero-size operands: nothing to quantize; lax gives the (empty or zero)
  # result and gradients.
  if not any(stored) and (config is None or config.is_float or empty):
    out = prims.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
    return out if state is None else (out, state)
  if not stored[0]:
    lhs = jnp.asarray(lhs)
    check_float(lhs, 'lhs')
  if not stored[1]:
    rhs = jnp.asarray(rhs)
    check_float(rhs, 'rhs')
  plan = Plan.create(
    lhs, rhs, dimension_numbers, config, precision, preferred_element_type
  )
  plan.check_transforms(backward=False)
  if config.needs_key and key is None:
    raise ValueError(
      "config uses stochastic rounding (or a transform with signs='key') "
      'and needs a PRNG key: pass key=jax.random.key(seed) (a raw '
      'jax.random.PRNGKey works too).'
    )
  key = key if config.needs_key else None
  check_operands(lhs, rhs, plan)
  typed = {} if state is None else slot_state.from_tree(state)
  slot_state.check_state(plan, typed)
  # lax's output type reads the operands' shardings (a stored QTensor is
  # seen as its replicated float shape).
  structs = [
    op.struct if op.stored else x
    for x, op in ((lhs, plan.lhs), (rhs, plan.rhs))
  ]
  if state is not None:

    def run_state(lhs, rhs, key, typed):
      out, new = quantized_dot(lhs, rhs, key, typed, None, plan)
      return out, slot_state.to_tree(new)

    args = (lhs, rhs, key, typed)
    return run_on_mesh(run_state, args, structs, plan, out_sharding, state)

  def run(lhs, rhs, key):
    return quantized_dot(lhs, rhs, key, {}, None, plan)[0]

  return run_on_mesh(run, (lhs, rhs, key), structs, plan, out_sharding)


def _broadcasting(lhs, rhs, bc: Broadcast, config, *, out_sharding, **kw):
  """`dot_general` of operands whose size-1 batch axes broadcast (`bc`)."""
  if bc.lhs_squeeze:
    lhs = jnp.squeeze(lhs, bc.lhs_squeeze)
  if bc.rhs_squeeze:
    rhs = jnp.squeeze(rhs, bc.rhs_squeeze)
  got = dot_general(lhs, rhs, bc.dimension_numbers, config, **kw)
  out, state = got if kw['state'] is not None else (got, None)
  if bc.perm is not None:
    out = out.transpose(bc.perm)
  if out_sharding is not None:
    out = jax.lax.with_sharding_constraint(out, out_sharding)
  return out if state is None else (out, state)
