"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: `request.py` maps the request onto
a chat request, `output.py` builds the response object and its streamed events, `route.py` is the
endpoint."""
