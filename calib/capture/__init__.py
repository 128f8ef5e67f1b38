"""Seeing K and V as the cache stores them: the attention hook (hook), the range observers (observers), the
fused reductions they run (kernels), what a recipe asks to record (spec), statistics on disk (statsfile)
and their merge across processes (distributed)."""
