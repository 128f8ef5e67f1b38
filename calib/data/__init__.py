"""Calibration text in, token batches out: reading and tokenising sources (sources), chat transcripts
through the model's template (chat), and cutting tokens into padded batches (batching).

Not to be confused with the repository's data/ folder of sample files (shipped as calib.sample_data and
found through calib.resources).
"""
