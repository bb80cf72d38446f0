"""Fiddle tags on the contraction op fields of the Pax-style layers.

A layer's op field carries its role as `Annotated[EinsumOp | None, Tag]`, so
every `fdl.Config` of the layer is pre-tagged and injection rules (or
`fdl.set_tagged`) can pick ops by role instead of by path:

  WeightOp      an activation contracted with a trained weight (projections,
                feed-forward, softmax / embedding logits, convolutions);
                the weight is always the op's rhs operand.
  ActivationOp  two activations contracted together (attention QK^T and
                PV); neither operand is a parameter.

Example:
  >>> import fiddle as fdl, aqtr.pax
  >>> cfg = fdl.Config(aqtr.pax.Linear, features=4)
  >>> sorted(t.name for t in fdl.get_tags(cfg, 'einsum'))
  ['aqtr.pax.tags.WeightOp']
"""

from __future__ import annotations

import fiddle as fdl

__all__ = ['ActivationOp', 'WeightOp']


class WeightOp(fdl.Tag):
  """A contraction of an activation (lhs) with a trained weight (rhs)."""


class ActivationOp(fdl.Tag):
  """A contraction of two activations (attention QK^T and PV)."""
