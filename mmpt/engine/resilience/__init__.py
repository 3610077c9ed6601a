"""Optional resilience for runs on many ranks, off unless the config asks (`train.rank_health`,
`train.adaptive_batch`): collective timing (`collective_timing`), rank health from those timings (`health`), and
per-rank micro-batches that follow each rank's speed (`adaptive_batch`). Off, nothing in torch.distributed or
DeepSpeed is replaced and no hook sits in the step."""
