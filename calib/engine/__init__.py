"""Real serving engines in `kvcalib eval`: each arm measured by the engine itself, next to the emulation.

The engine runs in its own environment through a runner script (`protocol.py` is the format, `answer.py`
checks the runner's answer, `driver.py` runs it, `vllm_runner.py` is vLLM's); kvcalib never imports an engine.
`run.py` maps evaluation arms to engine runs, `metrics.py` turns raw log-probabilities into the
report's numbers, `verdict.py` decides which numbers a verdict reads, `formats.py` chooses among KV formats
by bytes per token, and `report.py` shows emulation and engine side by side.
"""
