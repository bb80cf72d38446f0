"""Offline data sets for the main job: no download needed.

* `stdlib`: a byte-level language-modeling corpus made of the Python
  standard library's own `.py` sources, split by file.
* `digits`: scikit-learn's bundled 8x8 digits (optional dependency).
* `loader`: deterministic batching from a seed.

Not imported by `import aqtr`; import `aqtr.data` explicitly.

Example:
  >>> from aqtr import data
  >>> data.stdlib.VOCAB_SIZE
  256
"""

from aqtr.data import digits, loader, stdlib

__all__ = ['digits', 'loader', 'stdlib']
