"""What a calibration run is asked to do: the Recipe (recipe), the KV-cache dtypes and observers a recipe may
name (dtypes), scale granularities (granularity) and the YAML loader that reads recipes safely (safeyaml).

Torch-free, so a recipe validates (and `kvcalib recipes`, `verify` run) without loading torch.
"""
