"""The OpenAI Responses API (``/v1/responses``) as a layer over chat completions.

``routes.py`` (thin) → ``service.py`` (``ResponsesService``: stored conversations,
``previous_response_id``, store, retrieve, delete) → ``convert.py`` (a Responses request →
``ChatCompletionRequest``; a chat body → the Response object) → ``OpenAIServing.chat(...,
endpoint="responses")``; streamed chat chunks become Responses events in ``events.py``.
The request and answer shapes are in ``protocol.py``.
"""
