# SPDX-License-Identifier: BSD-3-Clause
"""AES-128-GCM throughput of the lanes' two engines on one core.

The lanes channel seals each chunk of an encrypted connection as an
AES-128-GCM record of up to 256 KiB (csrc/channel/lanes) and the receiver
opens it in place. ``Aead`` (csrc/common/crypto.h) does that with our own
VAES code where the CPU has it (csrc/common/aes_gcm_vaes.cpp) or with
libcrypto's EVP. This times both on the same records, in one run, with no
Python between records (``_testing.aead_seconds``; needs a build with
TORCH_RPC_EXT_BUILD_TESTING=1). One JSON line per engine, operation and
record size, then the ratio lines (ours / libcrypto's, above 1: ours
faster)::

  {"bench": "aead", "engine": "vaes", "op": "seal", "record_kib": 256,
   "gb_s": 13.1}
  {"bench": "aead", "op": "seal", "record_kib": 256,
   "ratio": "vaes_vs_libcrypto", "value": 1.9}

  python benchmarks/aead_bench.py --out r.jsonl     # ~10 s
"""

import argparse
import json
import sys

from torch_rpc_ext import _testing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records-kib", nargs="+", type=int, default=[16, 64, 256],
                   help="record sizes, KiB (the lanes use 256)")
    p.add_argument("--total-mib", type=int, default=16, help="bytes per timed pass, MiB")
    p.add_argument("--rounds", type=int, default=20, help="passes; the best counts")
    p.add_argument("--out", help="also append the lines to this file")
    args = p.parse_args(argv)
    engines = ["libcrypto"]
    if _testing.aes_gcm_vaes_supported():
        engines.append("vaes")
    else:
        print("aead_bench: this CPU has no AVX-512 VAES: libcrypto only", file=sys.stderr)
    lines = []
    total = args.total_mib << 20
    for kib in args.records_kib:
        for op in ("seal", "open"):
            speed = {}
            for engine in engines:
                seconds = _testing.aead_seconds(engine, op == "open", kib << 10, total,
                                                args.rounds)
                speed[engine] = total / seconds / 1e9
                lines.append({"bench": "aead", "engine": engine, "op": op, "record_kib": kib,
                              "total_mib": args.total_mib, "gb_s": round(speed[engine], 2)})
            if len(speed) == 2:
                lines.append({"bench": "aead", "op": op, "record_kib": kib,
                              "ratio": "vaes_vs_libcrypto",
                              "value": round(speed["vaes"] / speed["libcrypto"], 2)})
    out = open(args.out, "a") if args.out else None
    for line in lines:
        text = json.dumps(line)
        print(text)
        if out:
            out.write(text + "\n")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
