"""An attacking tenant's HTTP client in its own process (as on another machine): its
event loop, JSON and sockets never share the GIL of the server under test, so what the
neighbour measures is the server's cost of the attack, not the test client's.

Run as ``python attack_client.py CONFIG_JSON``; config: ``url``, ``key``, ``bodies`` (the
request bodies, cycled over), ``workers`` (concurrent requests), ``repeat`` (send the next
request when one ends, until terminated; else one each) and ``progress`` (a file the
counts ``{"done": n, "failed": m}`` are written to after every response). SIGTERM stops
it; its open requests are then dropped (the server sees the disconnects)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx


async def main(cfg: dict) -> None:
    counts = {"done": 0, "failed": 0}
    bodies, workers = cfg["bodies"], cfg["workers"]
    headers = {"Authorization": f"Bearer {cfg['key']}"}

    def record(ok: bool) -> None:
        counts["done" if ok else "failed"] += 1
        tmp = cfg["progress"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(counts, f)
        os.replace(tmp, cfg["progress"])

    async def worker(client: httpx.AsyncClient, w: int) -> None:
        i = w
        while True:
            r = await client.post(f"{cfg['url']}/v1/completions", json=bodies[i % len(bodies)],
                                  headers=headers)
            record(r.status_code == 200)  # the attacker's own 429/503s are its business
            if not cfg["repeat"]:
                return
            i += workers

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client, w) for w in range(workers)))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(main(json.loads(sys.argv[1])))
