"""One module per model family (as vLLM's ``model_executor/models/``): each turns a Hugging
Face config into the :class:`~loramux.engine.model.spec.DecoderSpec` the shared forward pass
(``decoder.py``) runs. A family's row (``adapters.families``) names its module here; a family
whose checkpoints name things their own way keeps those names in its module."""
