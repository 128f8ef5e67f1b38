"""kvcalib: calibrate FP8 KV-cache scales on your own text and export checkpoints serving engines load.

Stages, one module each: data → model → observe → scales → export (→ evaluation), glued by `pipeline`,
configured by `recipe`, driven by `cli`. This package import is kept free of torch.
"""

__version__ = "0.1.0"
