"""The `Sampler` protocol and its backends: the lean HF decode loop, an OpenAI-compatible server and client, and vLLM on GPU nodes."""
