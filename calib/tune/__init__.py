"""`kvcalib tune`: choose a model's KV-cache recipe from measurements instead of by hand.

Why: the choices (dtype, granularity, observer, headroom, q_scale, layers kept in the model dtype) interact
with the model, the data and the engine, and each used to be a separate calibrate + eval. Tune records the
statistics once, scores every recipe the target engine can load with the same engine-faithful emulation
`kvcalib eval` uses, adds layer skips ranked by measured sensitivity, and writes the chosen checkpoint.

Modules: `space` (candidates per engine), `stats` (one pass, one statistics file per observer), `score`
(candidates as evaluation arms, paired noise), `search` (the run), `choose` (the rule), `confirm` (the
short list in the real engine), `output` (OUT: checkpoint + tune.json/md/svg), `cli` (the command).
Importing this package is cheap (no torch): the command line imports it at start-up.
"""
