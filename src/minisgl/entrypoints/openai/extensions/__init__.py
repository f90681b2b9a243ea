"""What vLLM and SGLang add to OpenAI's API, for the clients written for them: their request fields,
each honoured or refused by name (`peer_fields.py`), their structured-output fields (`structured.py`),
and a reasoning model's `reasoning_content` (`reasoning.py`)."""
