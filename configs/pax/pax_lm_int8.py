"""Quantize the existing LM experiment (`pax_lm.py`) with a few rules.

Nothing in `pax_lm.py` or in `aqtr/pax` layer code changes: the rules
below are applied to the experiment's model config by `aqtr.pax.inject`,
which prints (logs) which op got which config.

  python configs/pax/pax_lm_int8.py   # prints the report, trains 40 steps
"""

from __future__ import annotations

import pathlib
import sys

import fiddle as fdl

import aqtr.pax
from aqtr.pax import Rule, tags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pax_lm  # noqa: E402 (the sibling experiment file)

# First matching rule wins.
RULES = [
  # Keep the activation x activation einsums (QK^T, PV) in float.
  Rule(None, tag=tags.ActivationOp),
  # Tied embedding/softmax logits: int8 weights, float activations.
  Rule('int8_weight_only', path='embedding'),
  # Every remaining projection (Q, K, V, O, feed-forward): int8 fwd + bwd.
  Rule('int8', layer=aqtr.pax.Linear),
]

MIXED_PRECISION = pathlib.Path(__file__).with_name('pax_lm_mixed.json')


def experiment() -> fdl.Config[pax_lm.Experiment]:
  """The float experiment with int8 injected by `RULES`."""
  exp = pax_lm.experiment()
  exp.model, _ = aqtr.pax.inject(exp.model, RULES, strict=True)
  return exp


def mixed_precision_experiment() -> fdl.Config[pax_lm.Experiment]:
  """The float experiment with per-layer bits from `pax_lm_mixed.json`."""
  exp = pax_lm.experiment()
  rules = aqtr.pax.mixed_precision_rules(MIXED_PRECISION)
  exp.model, _ = aqtr.pax.inject(exp.model, rules, strict=True)
  return exp


def main() -> None:
  exp = pax_lm.experiment()
  exp.model, report = aqtr.pax.inject(exp.model, RULES, strict=True)
  print(report)
  losses = pax_lm.train(exp)
  print(f'loss: first {losses[0]:.3f}  last {losses[-1]:.3f}')


if __name__ == '__main__':
  main()
