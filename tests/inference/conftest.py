"""tests/ (multiprocess), tests/torchrec (models) and tests/checkpoint (run_ranks) on the path; spawned ranks inherit it."""
import os
import sys

_tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _tests)
sys.path.insert(0, os.path.join(_tests, "torchrec"))
sys.path.insert(0, os.path.join(_tests, "checkpoint"))
