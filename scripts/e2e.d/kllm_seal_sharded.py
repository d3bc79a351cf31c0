#!/usr/bin/env python3
"""`kllm seal` (kLLM 0.1.0's own command line) with smaller shards.

    kllm_seal_sharded.py SHARD_BYTES -- <arguments of `kllm seal`>

kLLM cuts shards at 4 GiB, so a tiny model seals into one file. This runs the same CLI
with that limit lowered, to give the mount a multi-shard model with an index.
"""

import sys

from kllm.keyed.schemes import seal

seal._SHARD_BYTES = int(sys.argv[1])
args = sys.argv[2:]
if args[:1] == ["--"]:
    args = args[1:]

from kllm.cli import main  # noqa: E402

sys.exit(main(["seal", *args]))
