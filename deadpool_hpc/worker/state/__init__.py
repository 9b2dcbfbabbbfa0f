"""What ``ctx.protect`` keeps, by kind of state, one object each, held by worker/protect.py's ``Protected``: the
snapshot layout (``SnapshotLayout``), the data-parallel shares (``DataParallelShares``), the FSDP2 shards
(``ShardedState``), the per-rank document (``RankDocument``); the data loader's guard (``LoaderGuard``)."""
