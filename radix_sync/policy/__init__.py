"""Pure replication and routing policies: snapshot + `now` in, decisions out.

The same objects run in the live coordinator (active or shadow mode) and in the simulator (`radix_sync.sim`).
Nothing here reads a clock, a socket, SGLang or torch.
"""
