"""The worker-to-worker data plane: how a replica's pages go from the source worker to the target, on the agent's
I/O thread. Nothing here touches SGLang.

    transport.py      the `Transport` interface, the facts a transport reports, the settings it reads
    registry.py       transports by name (`--kvrep-transport`: "zmq", the default, "nixl" or "mooncake")
    zmq_transport.py  `ZmqTransport`, the default implementation
    written.py        `WrittenTransport`: ZMQ control, each chunk WRITTEN by a transfer engine straight into the
                      target's registered staging buffer (`TransferReady` gives its address)
    nixl_transport.py `NixlTransport` (`--kvrep-transport nixl`): the engine is NIXL (UCX)
    mooncake_transport.py `MooncakeTransport` (`--kvrep-transport mooncake`): Mooncake Transfer Engine
    staging.py        transfer state on each end and the reused receive buffers
    checks.py         what a target checks before it writes anything (geometry, grant)
    wire.py           chunk framing, the per-link rate cap, a small blocking client (tests and tools)

Wire: a ZMQ ROUTER on each worker's data endpoint; senders connect a DEALER. A transfer is `TransferHeader`, then
`num_chunks` x (`TransferChunk`, raw payload frame), then `TransferEnd`; the target answers `TransferAccepted` or
`TransferRefused`. A chunk is a run of whole pages of every layer, checksummed on its own, so the source sends a
chunk while it gathers the next and the target verifies each chunk on arrival:

    staging buffer, viewed (layers, pages, page bytes):     chunk k (pages [a, b)), viewed (layers, b - a, page bytes)
      layer 0: | p0 | p1 | ... | pa ... pb | ... |   <----   | pa ... pb |   (layer 0 rows of the chunk)
      layer 1: | p0 | p1 | ... | pa ... pb | ... |   <----   | pa ... pb |   (layer 1 rows)

With keys (`--kvrep-keys`, `radix_sync.keys`) both ends are CurveZMQ: the ROUTER admits only allow-listed worker
keys and binds a header's `source_id` to its connection's key, a DEALER connects only to the target's own key;
every socket has a frame-size limit (`--kvrep-max-data-msg-bytes`, `--kvrep-max-control-msg-bytes`).

A transfer is atomic for the target: bytes are staged and handed to the scheduler thread only once every chunk
arrived and verified.
"""
