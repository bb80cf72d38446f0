"""Stateful and learned calibrations: state in, new state out, purely.

A calibration may keep state across steps (an amax history, running
statistics) and learned parameters (an LSQ step, a PACT clip). Configs
stay hashable and hold no state: the state is an explicit pytree argument
of `aqtr.dot_general(..., state=s)`, which then returns `(out, new_state)`.

The state tree. One entry per operand path that has a stateful
calibration ('fwd.lhs', 'fwd.rhs', 'dlhs.lhs', 'drhs.lhs'), each a dict
`{'stats': {...}, 'learned': {...}}` of float32 arrays made by the
calibration's `init_state` (`aqtr.state.init` builds the whole tree).

The mechanism ("the cotangent carries the backward state"). The state tree
is a differentiable input of the one custom VJP, and:

  forward   out, new_state = dot(...): the forward operands' stats are
            updated in `new_state` (a primal output);
  backward  the cotangent returned for the state input holds, per path,
            the backward operands' NEW stats (dlhs.lhs, drhs.lhs: the
            gradient amax history is only known there) and, for the
            forward operands, the true gradient of the learned parameters
            (zeros for their stats).

`aqtr.state.split(state_grads)` separates the two: learned-parameter
gradients (to an optimizer) and backward-pass stats; `aqtr.state.merge`
builds the next state. Why this and not a side channel: the backward state
leaves the VJP by the only pure road JAX has, so it works unchanged under
jit, scan, remat, vmap and sharding, and needs no mutable collection. It
is MaxText's "overwrite with gradient" made explicit and typed: the
stats' "gradient" is never summed into an optimizer, `split` takes it out.
Contract: each state leaf feeds exactly one dot_general call (a shared
leaf's cotangents would add up) and the caller differentiates the loss
w.r.t. the state (else the backward stats are lost, documented, not an
error).

Learned parameters get their real gradient from the same VJP: a learned
calibration gives `h = d xhat / d param` per element and the mask of its
own straight-through rule; d loss / d param = sum_G (dL/dxhat * h) times
its gradient scale, where dL/dxhat is the (unmasked) operand gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.core.algorithms import (
  Calibration,
  StatefulCalibration,
  group_shape,
)

# Operand paths that may hold state, and those that may hold learned params.
STATE_PATHS = ('fwd.lhs', 'fwd.rhs', 'dlhs.lhs', 'drhs.lhs')
LEARNED_PATHS = ('fwd.lhs', 'fwd.rhs')
ALL_PATHS = STATE_PATHS + ('dlhs.rhs', 'drhs.rhs')


__all__ = ['StatefulCalibration', 'group_shape', 'is_stateful', 'site_bound']


def is_stateful(calibration: Calibration) -> bool:
  return isinstance(calibration, StatefulCalibration)


def _shapes(tree) -> object:
  return jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.result_type(a)), tree)


def check_site_state(cal, state, x, axes, numerics, path: str) -> None:
  """Raises a clear error when `state` does not fit `cal` at `path`."""
  if state is None:
    raise ValueError(
      f'{path}: calibration {type(cal).__name__} is stateful and needs '
      'state: call aqtr.dot_general(..., state=aqtr.state.init(lhs, rhs, '
      'dimension_numbers, config)).'
    )
  want = (
    jax.eval_shape(
      lambda: cal.init_state(
        jax.ShapeDtypeStruct(x.shape, x.dtype), axes, numerics
      )
    )
    if not cal.init_from_data
    else jax.eval_shape(lambda v: cal.init_state(v, axes, numerics), x)
  )
  try:
    got_s, want_s = _shapes(state), _shapes(want)
  except Exception as e:  # noqa: BLE001 - any malformed tree.
    raise ValueError(f'{path}: malformed state {state!r}.') from e
  if jax.tree.structure(state) != jax.tree.structure(want) or got_s != want_s:
    raise ValueError(
      f'{path}: state of {type(cal).__name__} has the wrong shape: got '
      f'{got_s}, expected {want_s}; build it with aqtr.state.init for this '
      'dot and config.'
    )


def site_bound(cal, x, axes, numerics, state, path: str):
  """(bound, new_state) for one operand (`path` names it in errors)."""
  check_site_state(cal, state, x, axes, numerics, path)
  bound, new = cal.bound_with_state(x, axes, numerics, state)
  return bound, new


# Shape recording for aqtr.state.init (the gradient operands' views are
# only known by tracing the backward pass; see aqtr/state.py).
_recording: list | None = None


def start_recording() -> None:
  global _recording
  _recording = []


def stop_recording() -> list:
  global _recording
  out, _recording = _recording or [], None
  return out


def record(path: str, x: jax.Array, axes: Sequence[int]) -> bool:
  """While recording, notes the view shape at `path`; True if recording."""
  if _recording is None:
    return False
  _recording.append((path, jax.ShapeDtypeStruct(x.shape, x.dtype), axes))
  return True
