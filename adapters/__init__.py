"""loramux.adapters – the PEFT LoRA adapter format.

- :mod:`~loramux.adapters.format` ``load_adapter`` (read, no base-model checks; the engine's
  loader), ``validate_adapter`` (every upload check against a base model config),
  ``AdapterValidationError``; the tensor names and shapes it checks in
  :mod:`~loramux.adapters.layout`
- :mod:`~loramux.adapters.weights` ``LoraWeights`` (a loaded adapter), ``save_adapter``
- :mod:`~loramux.adapters.spec` ``adapter_config.json`` → ``LoraSpec`` (read size-capped,
  checked field by field, features that change the math refused); ``DEFAULT_MAX_LORA_RANK``
- :mod:`~loramux.adapters.archive` folders and ``.tar.gz`` / ``.zip`` uploads, extracted
  safely (no absolute paths, ``..``, links or devices; member count and size caps)
- :mod:`~loramux.adapters.safetensors_io` safetensors header checks before any tensor is
  read; nothing in this package unpickles or calls ``torch.load``
- :mod:`~loramux.adapters.arch` the supported base models as the package reads them: which
  family a config is, the modules LoRA may target in it, the shapes they imply
- :mod:`~loramux.adapters.families` one ``ModelFamily`` row per family (Llama/Mistral/Qwen2,
  Qwen3, Gemma 3, Gemma 2, Phi-3/4, Qwen3-MoE, Mixtral; ``register_family`` adds one);
  :mod:`~loramux.adapters.projections` the projections' names and PEFT's tensor keys
- :mod:`~loramux.adapters.fused` an adapter on split names rewritten in a fused family's
  names (Phi-3's ``qkv_proj``) for PEFT
- :mod:`~loramux.adapters.merge` ``export_merged`` (PEFT ``merge_and_unload`` to a Hugging
  Face folder) and ``check_merged`` (logits of the merged model vs base + adapter)

Imports stay light: ``import loramux.adapters`` loads nothing heavy; import the modules.
"""
