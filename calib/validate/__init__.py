"""`kvcalib validate`: before turning FP8 KV on in production, quality and serving speed per arm in the real engine.

Thin over the evaluation (calib.evaluation.run, which measures quality in the engine and the emulation) and the
engine's serving phase (calib.engine.serving: TTFT, TPOT, ITL, throughput, capacity, memory, preemptions).
"""
