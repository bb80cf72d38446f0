"""Which weight ops get adapters, by rules, and their initial values.

`lora_rules` reads the rules of `aqtr.lora.attach` (a LoraConfig, {path
regex: LoraConfig}, or (Rule, LoraConfig) pairs); `check_used` names the
first rule that set no adapter; `initial` draws A Kaiming-uniform (bound
1/sqrt(d_in)) and B zeros (LoRA, Hu et al. 2021, arXiv 2106.09685);
`codebook_table` is the base's codebook when it is stored as codes (nf4).
Shared by the stock-model adapters (`aqtr.lora.adapters`) and the Pax
ones (`aqtr.lora.pax`).

Example:
  >>> from aqtr.lora.config import LoraConfig
  >>> ((rule, cfg),) = lora_rules({'up': LoraConfig(rank=2)})
  >>> rule.path, cfg.rank
  ('up', 2)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.flax.sites import WeightSite
from aqtr.lora.config import LoraConfig, base_config
from aqtr.lora.session import adapter_shapes
from aqtr.numerics.codebook import Codebook
from aqtr.rules import Rule

__all__ = ['check_used', 'codebook_table', 'initial', 'lora_rules']


def lora_rules(rules: Any) -> tuple[tuple[Rule, LoraConfig], ...]:
  """`rules` as (selector, LoraConfig) pairs.

  Args:
    rules: a LoraConfig (every weight op), {path regex: LoraConfig}, or a
      sequence of (Rule, LoraConfig) pairs (the Rule selects ops by
      path / layer / op kind; its `config` must be None).
  """
  if isinstance(rules, LoraConfig):
    rules = [(Rule(), rules)]
  elif isinstance(rules, dict):
    rules = [(Rule(path=p), c) for p, c in rules.items()]
  if not isinstance(rules, list | tuple) or not rules:
    raise TypeError(
      'aqtr.lora: rules must be a LoraConfig, {path regex: LoraConfig} or '
      f'a non-empty list of (Rule, LoraConfig) pairs, got {rules!r}.'
    )
  out = []
  for pair in rules:
    if (
      not isinstance(pair, tuple | list)
      or len(pair) != 2
      or not isinstance(pair[0], Rule)
      or not isinstance(pair[1], LoraConfig)
    ):
      raise TypeError(
        f'aqtr.lora: each rule must be a (Rule, LoraConfig) pair, got {pair!r}.'
      )
    sel, cfg = pair
    if sel.config is not None:
      raise ValueError(
        f'aqtr.lora: {sel.label()} sets a config; the base format is '
        'LoraConfig.base: leave Rule.config None.'
      )
    if sel.weight is False:
      raise ValueError(
        f'aqtr.lora: {sel.label()} selects ops without a weight operand '
        '(activation x activation); adapters need a parameter: drop '
        'weight=False.'
      )
    out.append((sel, cfg))
  return tuple(out)


def check_used(
  selectors, used: set[int], hits: set[int], convs: frozenset = frozenset()
) -> None:
  """One line for the first rule that set no adapter.

  Args:
    selectors: the rules' selectors, in order.
    used: indices of rules that set an adapter.
    hits: indices of rules that matched activation x activation ops.
    convs: indices of rules that matched convolutions (no adapters).
  """
  for i, sel in enumerate(selectors):
    if i in used:
      continue
    if i in convs:
      raise ValueError(
        f'aqtr.lora: rule {i} {sel.label()} matches only convolutions; '
        'adapters go on dot_general / einsum weight ops (Dense, Einsum, '
        'attention projections), not on convolutions: point it at those.'
      )
    if i in hits:
      raise ValueError(
        f'aqtr.lora: rule {i} {sel.label()} matches only ops without a '
        'weight operand (activation x activation, e.g. attention scores); '
        'adapters need a parameter: point it at the weight ops.'
      )
    raise ValueError(
      f'aqtr.lora: rule {i} {sel.label()} matches no weight op (or only '
      'ops an earlier rule took); fix its path / layer / op.'
    )


def codebook_table(cfg: LoraConfig) -> tuple[float, ...] | None:
  """The base's codebook values when it is stored as codes (nf4), or None."""
  bc = base_config(cfg.base)
  n = None if bc is None else bc.fwd.rhs.numerics
  return tuple(n.table) if isinstance(n, Codebook) else None


def initial(key, site: WeightSite, rank: int, lead: tuple[int, ...] = ()):
  """A: Kaiming-uniform (bound 1/sqrt(d_in)); B: zeros."""
  a_shape, b_shape = adapter_shapes(site, rank)
  d_in = math.prod(a_shape[:-1])
  bound = 1.0 / math.sqrt(d_in)
  a = jax.random.uniform(key, (*lead, *a_shape), jnp.float32, -bound, bound)
  return a, jnp.zeros((*lead, *b_shape), jnp.float32)
