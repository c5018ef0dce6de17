import os
import sys

# tests import their helpers (rank_pool) by module name; workers spawned by rank_pool inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings

# CI runs each property on the same examples every time (a red CI must be reproducible, and a flaky one does not
# land); the strategies, not reruns, give the coverage.  HYPOTHESIS_PROFILE=explore draws fresh examples.
settings.register_profile("ci", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
