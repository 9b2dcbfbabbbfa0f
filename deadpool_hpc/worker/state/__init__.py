"""What ``ctx.protect`` keeps, by kind of state: the snapshot layout, the data-parallel shares, the FSDP2 shards
(mixed into worker/protect.py's ``Protected``), the per-rank document (``RankDocument``, held by it)."""
