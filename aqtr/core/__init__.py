"""The engine: quantized dot_general / einsum / conv and their config tree.

Layers of aqtr, from the bottom; a module imports only from its own layer
or the ones below (tests/test_layering.py enforces it):

  1. core         this package: jax, numpy and the standard library only;
                  no Fiddle, Flax, Pax or training code. Inside it, from the
                  bottom: registry, markers, rounding, algorithms (the base
                  types of the families), config, dimension_numbers,
                  qtensor, sparsify, quantizer, passes, dot_general (the
                  one custom VJP), then operand, einsum, conv.
  2. families     calibrations, numerics, tilings, sparsity, freezers:
                  registered
                  algorithms, importing only the core's base types (core
                  names its defaults by registry name, never by import).
  3. tooling      presets, validation, tags, fiddle, fiddlers, selectors,
                  gin, flags: building and editing configs.
  4. frameworks   flax, pax: adapters to model libraries.
  5. job          train, data, demo: the reference training job.
"""
