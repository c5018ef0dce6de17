"""Renamed to ``bench_peers.py`` (FSDP2, DeepSpeed ZeRO-3, DDP and shardtensor in one run); this name forwards there.

    python benchmarks/bench_fsdp2.py ARGS   ==   python benchmarks/bench_peers.py ARGS
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import *  # noqa: E402,F401,F403  (old importers: the same names)
from bench_peers import _parse, _warm_up_config, _warm_up_optimizer, _wrap, main  # noqa: E402,F401

if __name__ == "__main__":
    main()
