"""Ray Serve deployment of the engine: an OpenAI-compatible HTTP endpoint (docs/reference.md, docs/serve.md)."""
