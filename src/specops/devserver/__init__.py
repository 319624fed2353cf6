"""A development stand-in for SGLang: one causal LM from a local directory behind SGLang's HTTP API.

It serves the endpoints and semantics the project relies on (readiness via /health_generate,
/generate with exact token ids, streamed or not, model and server info, load, /flush_cache, pause
modes, memory release and resume, the API key, graceful SIGTERM) and, by default, fails where the
imitated SGLang release fails (`--sglang-version`, 0.5.23 or 0.5.4), so the roles and stages can be
exercised without a GPU or SGLang installed. Run it with
`python -m specops.devserver --model-path DIR --port 30000`.
"""
