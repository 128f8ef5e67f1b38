"""Routes: one FP8-or-BF16 decision per traffic class, from one evaluation per route.

A service rarely has one kind of traffic: short chat, long documents and agents differ in length and in how
much quality loss they tolerate. `kvcalib plan --routes routes.yaml` reads named routes (spec.py: each with its
held-out data, length buckets and bar), runs `kvcalib eval` once per route on the same arms, and writes a
per-route decision with the exact `vllm serve` command and a plan.json a router can read (plan.py).
"""
