"""sglang_kvrep: the SGLang plugin, everything that runs inside an SGLang server. Loaded by SGLang through the
`sglang.srt.plugins` entry point; inert unless `--enable-kv-replication` is given.

    plugin.py     the hooks SGLang calls (flags, scheduler start, each iteration, prefix matches, evictions)
    config.py     the flags and the frozen `KvrepConfig` they make
    compat/       the one door to SGLang internals (hook targets, the scheduler's handles, the version check)
    events.py     the KV-event publisher that turns SGLang's cache events into our facts
    agent/        the worker agent: a scheduler-side and an I/O-side class and the typed mailbox between them
    replicas.py   replica install, expiry and budget (scheduler thread)
    dataplane/    pages worker to worker: the transport interface, ZeroMQ, staging, checks
"""
