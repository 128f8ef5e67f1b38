"""Evaluation: how far does an FP8 (or INT8) KV cache with given scales drift from the model's own dtype?

Why a package: choosing held-out text, running the measuring passes, storing K/V as an engine would and
writing the verdict are separate concerns with separate readers (`kvcalib eval`, `kvcalib tune`, the engine
comparison); each lives in one short module, and callers import each name from the module that defines it:

- config.py      `EvalConfig` (one `kvcalib eval` run) and the checks made before a model loads
- samples.py     held-out samples: length buckets, calibration windows left out, packing
- head.py        next-token log-probabilities a chunk of positions at a time
- session.py     what a measuring pass needs (model, hook, head, samples) and its clock
- measure.py     one pass over the samples: the reference once per batch, then every arm
- results.py     the typed results: per-bucket rows, passkey rows, per-arm and reference numbers, EvalResult
- arms.py        the arms (ways of storing the cache) an evaluation compares, and how each is built
- fakequant.py   the fake-quant hook that stores K/V as one arm would
- report.py      the verdict, report.json, report.md and the plots
- run.py         `run_eval`: checks, lock, load, measure, skip trials, engine, report
- emulate.py     what each engine computes when its KV cache is FP8 (one registry of modes, torch-free)
- dynamic.py     vLLM's per-token-head caches (FP8, INT8, INT4) as its kernels write and read them
- passkey.py     the passkey prompts (generated, no dataset), their exact-match scoring, retrieval under one arm
- significance.py  passkey decisions from an exact paired test (McNemar) and the prompts a drop needs
"""
