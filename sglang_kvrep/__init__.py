"""sglang_kvrep: the SGLang plugin (flags, the compatibility module, the worker agent, replicas, the worker side
of the data plane). Loaded by SGLang through the `sglang.srt.plugins` entry point; inert unless
`--enable-kv-replication` is given."""
