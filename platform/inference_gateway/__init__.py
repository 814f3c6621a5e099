"""loramux behind the Kubernetes inference gateways (Gateway API Inference Extension's
InferencePool with llm-d's endpoint picker, AIBrix, vLLM production stacks).

* ``facts.py``, ``exposition.py``, ``metrics_listener.py``, ``metrics_process.py``: the
  model-server protocol metrics (vLLM's ``vllm:*`` names) on ``--protocol-metrics-port``,
  served by a small child process from facts the engine side publishes;
* ``kv_events.py``: prefix-cache KV events over ZeroMQ (``--kv-events-endpoint``);
* ``runtime_lora.py``, ``routes.py``: vLLM's ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` (``--allow-runtime-lora-updating``).

This ``__init__`` imports nothing: the metrics child process imports only
``exposition.py`` (no torch, no engine).
"""
