"""The OpenAI-compatible HTTP API: one module per endpoint (chat, completions, responses, the
native /generate, health/models/metrics), each a thin route over the functions beside it, with the
request models (`protocol`), the streaming formats, tools and logprobs formatting."""
