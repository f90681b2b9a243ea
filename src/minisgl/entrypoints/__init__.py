"""What users call: the OpenAI-compatible HTTP API (`openai/`)."""
