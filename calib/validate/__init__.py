"""`kvcalib validate`: does FP8 KV raise throughput for this workload, at what quality?

Thin over the evaluation (calib.evaluation.run: quality in the engine and the emulation) and the serving half
(calib.load: each serve configuration started with `vllm serve`, swept with `vllm bench serve`, goodput at the
SLO, the engine's own capacity, and the decision).
"""
