"""Serving under load, as users serve: `vllm serve` per KV arm, `vllm bench serve` sweeping the requests in flight,
goodput at the user's SLO, and the decision it supports (`kvcalib validate`).

`spec` is the load and the SLO, `server` starts the engine's own server and load generator and watches the
server's metrics, `records` turns one level's per-request records into numbers, `sweep` runs one serve
configuration over the buckets, `decide` picks the arm from quality, capacity and goodput.
"""
