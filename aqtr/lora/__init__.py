"""LoRA and QLoRA: low-rank adapters on frozen (quantized) weights.

  LoraConfig        rank, alpha, dropout, base format ('nf4': QLoRA),
                    double_quant, adapter matmul config
  attach            adapters on a stock linen / nnx model's weight ops,
                    by rules; bases frozen in place of their kernels; or
                    on an `aqtr.pax` template (`LoraEinsum` injected by
                    Fiddle, `aqtr.lora.pax`)
  Adapter           the nnx variable type of A and B (the trainable set)
  trainable, partition, combine, optimizer, nnx_optimizer, check
                    only the adapters train; a trainable base is refused
  dropout           a context giving the adapters' dropout its PRNG key
  merge             adapters folded into re-quantized weights (serving)
  sizes             bytes: adapters, optimizer, frozen base vs full FT
  nf4               QLoRA's nf4 g64 weight config

Hu et al. 2021 (arXiv 2106.09685), Dettmers et al. 2023 (arXiv
2305.14314). Needs flax (`import aqtr` does not import this package).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> x = jnp.ones((2, 64))
  >>> m = attach(nnx.Linear(64, 8, rngs=nnx.Rngs(0)),
  ...            LoraConfig(rank=4, base='nf4'), x)
  >>> bool((m(x) == merge(m, x)(x)).all())  # B = 0: merged is the base
  True
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import flax  # noqa: F401
except ImportError as e:
  raise extras.missing('flax', 'aqtr.lora', e) from e

from aqtr.lora.adapters import Adapter, Site, attach, dropout, sites  # noqa: E402
from aqtr.lora.config import LoraConfig, nf4  # noqa: E402
from aqtr.lora.merge import Bytes, merge, sizes  # noqa: E402
from aqtr.lora.pax_op import LoraEinsum  # noqa: E402
from aqtr.lora.training import (  # noqa: E402
  check,
  check_nnx,
  combine,
  nnx_optimizer,
  optimizer,
  partition,
  trainable,
)

__all__ = [
  'Adapter',
  'Bytes',
  'LoraConfig',
  'LoraEinsum',
  'Site',
  'attach',
  'check',
  'check_nnx',
  'combine',
  'dropout',
  'merge',
  'nf4',
  'nnx_optimizer',
  'optimizer',
  'partition',
  'sites',
  'sizes',
  'trainable',
]
