"""One module per model family (as vLLM's ``model_executor/models/``): each turns a Hugging
Face config into the :class:`~loramux.engine.model.spec.DecoderSpec` the shared forward pass
(``decoder.py``) runs. ``registry.py`` maps a family (``adapters.arch.FAMILIES``) to its module."""
