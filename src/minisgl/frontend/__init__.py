"""The engine client inside the API server's process: request streams (stop strings, latency
metrics, echo, logprobs), the manager of the pipes to the tokenizer, routing to data-parallel
replicas, and the Prometheus metrics."""
