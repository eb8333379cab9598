# SPDX-License-Identifier: BSD-3-Clause
"""What a joiner of a dynamic group pays to start from the newest snapshot.

A joiner restores the roster from the snapshot (every member's join
record) before it reads the log past it (docs/elastic.md, "Snapshots"),
and so does a joiner that asks whether the epoch's group is still alive
(SecretExchange::liveMembers), every half second while it waits. Each join
record is checked against the members already there (names, ranks,
incarnations, device maps): this times `Roster::restore` of N members, in
one process, with no agent (``_testing.Roster``; a build with
TORCH_RPC_EXT_BUILD_TESTING=1). One JSON line per group shape, the best of
`--rounds`::

  {"bench": "roster_restore", "members": 1000, "offers": "maps",
   "snapshot_kb": 61.4, "restore_ms": 2.2}

  python benchmarks/roster_restore.py --out r.jsonl     # a few seconds
"""

import argparse
import json
import sys
import time

from torch_rpc_ext import _testing as t

# What each member publishes: nothing (a CPU group), a device, or a device
# and a map to the next member (a ring of CUDA workers).
OFFERS = ("none", "devices", "maps")


def offers_of(kind: str, i: int, n: int) -> str:
    if kind == "devices":
        return "devices 0"
    if kind == "maps":
        return f"devices 0\ndevicemap w{(i + 1) % n} 0:0"
    return ""


def restore_ms(n: int, kind: str, rounds: int) -> tuple[float, int]:
    r = t.Roster()
    for i in range(n):
        r.apply(t.join_record(i, f"w{i}", 0x1000 + i, 1000, offers_of(kind, i, n)))
    snap = r.snapshot()
    best = float("inf")
    for _ in range(rounds):
        copy = t.Roster()
        t0 = time.perf_counter()
        ok = copy.restore(r.epoch, snap)
        best = min(best, time.perf_counter() - t0)
        assert ok and copy.members() == r.members()
    return best * 1e3, len(snap)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", nargs="+", type=int, default=[64, 1000, 4000])
    p.add_argument("--offers", nargs="+", choices=OFFERS, default=list(OFFERS))
    p.add_argument("--rounds", type=int, default=3, help="restores per shape; the best counts")
    p.add_argument("--out", help="also append the lines to this file")
    args = p.parse_args(argv)
    rows = []
    for kind in args.offers:
        for n in args.members:
            ms, size = restore_ms(n, kind, args.rounds)
            rows.append({"bench": "roster_restore", "members": n, "offers": kind,
                         "snapshot_kb": round(size / 1e3, 1), "restore_ms": round(ms, 3)})
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
