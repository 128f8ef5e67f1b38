"""kvcalib: calibrate FP8 KV-cache scales on your own text and export checkpoints serving engines load.

Stages, one package each: data → model → capture → scales → export (→ evaluation, verify, tune), glued by
`pipeline`, configured by `recipe`, written safely by `safety`, driven by `cli`. Checkpoint layout and the
checks of its files live in `ckpt`. This package import is kept free of torch.
"""

__version__ = "0.1.0"
