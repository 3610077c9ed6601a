"""Memory and throughput planning: what a config needs per GPU and per host, the largest micro-batch
that fits, and a predicted step time, from a meta-device build and a fake-tensor run of the real model.

Modules, each with one job: `hardware` (GPU table and the stated assumptions), `build` (the model as
training builds it, on the meta device), `states` (model states per rank by ZeRO stage), `batches`
(synthetic micro-batches), `measure` (live-tensor bytes and FLOPs of one training step on fake tensors),
`logits` (the contrastive logits at the real world size), `comm` (bytes each rank sends per step),
`planner` (putting it together), `render` (text, JSON and the docs table).
"""
