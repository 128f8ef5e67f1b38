"""The checkpoint layout, torch-free: what kvcalib writes and reads in a model folder.

- `names`: file names and KV scale tensor names (built and parsed);
- `formats`: the quantization configs (compressed-tensors, ModelOpt) read and written, Quark's read;
- `weightmap`: the safetensors index (`model.safetensors.index.json`) parsed and written;
- `reader`: a written checkpoint read once (configs, index, shard headers, provenance, scale values),
  shared by verify, inspect and eval;
- `kvinfo`: what a checkpoint says about its KV cache (inspect, eval --scales);
- `source`: a source model folder checked for export (weight map, carried scales) before anything is written;
- `integrity`: safetensors files checked before they are read (headers, sizes, index agreement).

The engines' writers (calib.export) and rules (calib.verify) build on these; none of them imports torch.
"""
