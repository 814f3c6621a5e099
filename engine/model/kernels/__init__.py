"""The CPU kernels as ``torch.library`` operators (``torch.ops.loramux.*``).

- ``_C``: the compiled extension (``csrc/ops.cpp`` + the C kernels, one copy per ISA variant),
  built by the package build (``setup.py``) and shipped in the wheel and the image;
- :mod:`.loader`: loads it once, says whether the engine can use it (:func:`.loader.status`);
- :mod:`.ops`: the typed Python entry points the model code calls;
- :mod:`.fake`: the fake (meta) implementations that check shapes without data.
"""
