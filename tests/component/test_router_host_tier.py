"""A worker's host-memory tier, through real processes: a fake agent reports pages of SGLang's hierarchical cache
(medium `CPU_PINNED`) to a real coordinator process; two real router processes mirror its directory feed, one told
the workers' host tiers load back at 25 GB/s (`--host-load-gbytes-s 25`), one not. Worker A holds a prompt only in
host memory, worker B its first page on its device: the pricing router sends the prompt to A (loading 64 tokens of
Llama-3.1-8B KV at 25 GB/s, ~0.3 ms, beats prefilling 48 at the default 50 us a token), the other to B. No SGLang
server is started here (SGLang 0.5.23's hierarchical cache does not start on the CPU engine)."""
import json

from kvrep_dev.cluster import Coordinator, Router, local_keys
from radix_sync import protocol as p
from radix_sync.hashing import page_hashes
from radix_sync.host_tier import HOST_MEDIUM
from tests.component.test_router_process import ACME, KEYS, PAGE, Agent, call, ids, mirror_synced, ready, start_stub
from tests.util import wait_until


def store(agent: Agent, tokens, namespace, medium="GPU"):
    hashes = page_hashes(tokens, PAGE, namespace)
    blocks = [p.BlockFact(h, par, tokens[i * PAGE:(i + 1) * PAGE])
              for i, (h, par) in enumerate(zip(hashes, [None] + hashes[:-1]))]
    agent.seq += 1
    agent.sock.send(p.encode(p.PagesStored(worker_id=agent.wid, seq=agent.seq, namespace=namespace, blocks=blocks,
                                           medium=medium)))


def test_a_router_told_of_host_tiers_sends_a_prompt_to_the_worker_that_has_it_in_host_memory(tmp_path):
    keys = local_keys(tmp_path / "keys")
    (tmp_path / "tenants.json").write_text(json.dumps(KEYS))
    coord = Coordinator(tmp_path, extra_args=("--policy", "none", "--worker-timeout-s", "120"))
    a, b = start_stub("A", tmp_path, keys=keys), start_stub("B", tmp_path, keys=keys)
    common = ("--tenants", str(tmp_path / "tenants.json"), "--connect-timeout-s", "1")
    priced = Router(tmp_path, keys, coordinator=coord, workers=(a.url, b.url), name="router-priced",
                    extra_args=(*common, "--host-load-gbytes-s", "25"))
    plain = Router(tmp_path, keys, coordinator=coord, workers=(a.url, b.url), name="router-plain", extra_args=common)
    agents, started = [], []
    try:
        coord.wait_ready()
        agents = [Agent(coord, "wA", a.url), Agent(coord, "wB", b.url)]
        for proc in (a, b, priced, plain):
            wait_until(lambda: ready(proc.url), what=f"{proc.name} up")
        ns = priced.namespace("ns-acme")
        prompt = ids(7)  # 64 tokens, 4 pages
        store(agents[0], prompt, ns, HOST_MEDIUM)
        store(agents[1], prompt[:PAGE], ns)
        wait_until(lambda: coord.get("/status")[1]["feed"]["seq"] >= 5, what="the coordinator has the pages")
        assert coord.get("/status")[1]["num_host_pages"] == 4

        def routes(r, url):
            """Sends the prompt through `r`: whether it went to `url` on a decision from the directory."""
            status, _, raw = call(r.url + "/generate", {"input_ids": prompt}, ACME)
            assert status == 200, raw
            last = r.status()["last_decisions"][-1]
            return last["mode"] == "directory" and last["worker"] == url

        for r in (priced, plain):
            wait_until(lambda: mirror_synced(coord, r), what=f"{r.name}'s mirror in sync")
        # NOTE: a decision while the mirror's long poll is late (a loaded machine) asks the coordinator per request,
        # which answers device matches only: unpriced, to B; so the priced router is asked until it routes to A
        wait_until(lambda: routes(priced, a.url), what="the pricing router sending the prompt to A")
        assert priced.status()["coordinator"]["directory_replica"]["host_pages"] == 4
        # a router started after the pages were stored learns them from its first answer, a snapshot
        late = Router(tmp_path, keys, coordinator=coord, workers=(a.url, b.url), name="router-late",
                      extra_args=(*common, "--host-load-gbytes-s", "25"))
        started.append(late)
        wait_until(lambda: ready(late.url), what="router-late up")
        wait_until(lambda: mirror_synced(coord, late), what="router-late's mirror in sync")
        mirror = late.status()["coordinator"]["directory_replica"]
        assert mirror["snapshots"] >= 1 and mirror["changes"] == 0 and mirror["host_pages"] == 4, mirror
        wait_until(lambda: routes(late, a.url), what="the late router sending the prompt to A")
        directory = []  # the other router, on its decisions from the directory, never sends it to A

        def plain_decided():
            status, _, raw = call(plain.url + "/generate", {"input_ids": prompt}, ACME)
            assert status == 200, raw
            last = plain.status()["last_decisions"][-1]
            if last["mode"] == "directory":
                directory.append(last["worker"])
            return len(directory) >= 3
        wait_until(plain_decided, what="three decisions of the other router from the directory")
        assert directory == [b.url] * len(directory), directory
        # the host tier evicts them: the pricing router sends the prompt to B too
        agents[0].seq += 1
        agents[0].sock.send(p.encode(p.PagesRemoved(worker_id="wA", seq=agents[0].seq, medium=HOST_MEDIUM,
                                                    block_hashes=page_hashes(prompt, PAGE, ns))))
        wait_until(lambda: priced.status()["coordinator"]["directory_replica"]["host_pages"] == 0,
                   what="the host tier's eviction reaches the router")
        wait_until(lambda: routes(priced, b.url), what="the pricing router sending the prompt to B")
    finally:
        for agent in agents:
            agent.close()
        for proc in (*started, priced, plain, a, b, coord):
            proc.stop(5)
