"""What the Ray Data and Ray Serve adapters share in front of the engine: request validation, model paths on any
filesystem, and the metrics export. The engine (``decoding``) knows nothing of it."""
