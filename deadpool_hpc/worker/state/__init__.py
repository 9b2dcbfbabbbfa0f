"""What ``ctx.protect`` keeps, by kind of state: the snapshot layout, the data-parallel shares, the FSDP2 shards,
the per-rank document (worker/protect.py puts them together)."""
