"""`POST /v1/embeddings`: the route (`route.py`) and its request body (`protocol.py`)."""
