import os
import sys

# tests import their helpers (rank_pool) by module name; workers spawned by rank_pool inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
