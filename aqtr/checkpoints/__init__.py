"""Quantized checkpoints in the ecosystem's safetensors layouts.

  export(served, folder, format=...)   a served model -> safetensors + a
                                       Hugging Face style config.json
  load(model, folder, *sample)         such a checkpoint -> a serving
                                       model (frozen int codes, no float
                                       copy of a quantized weight)
  qlora(model, folder, lora, *sample)  such a checkpoint as the frozen
                                       base of LoRA adapters (QLoRA)
  read(folder)                         the stored weights, floats, config
  layouts                              'compressed_tensors' (pack-quantized,
                                       MXFP4, NVFP4), 'gptq' (act-order
                                       too), 'awq' (`layouts.names()`)

Layouts are codecs at the edge: they translate stored codes + scales (+
zero points) to and from files (`aqtr.checkpoints.stored.Stored`); only
`aqtr.checkpoints.tree` knows aqtr's serving trees. Needs flax.

Example:
  >>> import aqtr.checkpoints
  >>> aqtr.checkpoints.names()
  ('awq', 'compressed_tensors', 'gptq')
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import flax  # noqa: F401
except ImportError as e:
  raise extras.missing('flax', 'aqtr.checkpoints', e) from e

from aqtr.checkpoints import awq, compressed, gptq  # noqa: E402, F401
from aqtr.checkpoints.api import export, load, qlora, read  # noqa: E402
from aqtr.checkpoints.awq import Awq  # noqa: E402
from aqtr.checkpoints.compressed import CompressedTensors  # noqa: E402
from aqtr.checkpoints.gptq import Gptq  # noqa: E402
from aqtr.checkpoints.layouts import Layout, layout, names  # noqa: E402
from aqtr.checkpoints.stored import CheckpointError, Stored  # noqa: E402

__all__ = [
  'Awq',
  'CheckpointError',
  'CompressedTensors',
  'Gptq',
  'Layout',
  'Stored',
  'export',
  'layout',
  'load',
  'names',
  'qlora',
  'read',
]
