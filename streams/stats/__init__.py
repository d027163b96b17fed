"""The stats stream: a faust-streaming app aggregating results, dead letters and worker heartbeats into per-stage
numbers over the last minute (``schemas.ops.StageStats``), published to ``kiln.stats`` and served over HTTP.
Its agents only count; nothing long runs in them (faust-streaming's agent concurrency can lose data, #606)."""
