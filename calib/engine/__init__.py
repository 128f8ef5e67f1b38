"""Real serving engines in `kvcalib eval`: each arm measured by the engine itself, next to the emulation.

The engine runs in its own environment through a runner script (`protocol.py` is the format, `answer.py`
checks the runner's answer, `driver.py` runs it, `vllm_runner.py` is vLLM's); kvcalib never imports an engine.
`run.py` maps evaluation arms to engine runs (`serve.py` groups them into engine starts, `command.py` writes
their serve commands), `metrics.py` turns raw log-probabilities into the report's numbers.
"""
