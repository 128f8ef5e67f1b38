"""The model to calibrate: loading it and refusing caches we cannot calibrate (load), its KV geometry
(geometry), each layer's attention kind and the KV-bytes model (layer_kinds), its context as the engine derives
it (context), and the embedded default model built from a GGUF file (default_model, gguf_convert)."""
