"""Ray Serve deployment of the engine: an OpenAI-compatible HTTP endpoint (SPEC "HTTP"); see docs/serve.md."""
