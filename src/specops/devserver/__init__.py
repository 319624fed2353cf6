"""A development stand-in for SGLang: one causal LM from a local directory behind SGLang's HTTP API.

It serves the endpoints and semantics the project relies on (readiness via /health_generate,
/generate with exact token ids, model and server info, /flush_cache, memory release and resume,
graceful SIGTERM) so the roles and stages can be exercised without a GPU or SGLang installed.
Run it with `python -m specops.devserver --model-path DIR --port 30000`.
"""
