"""tests/multiprocess.py (run_ranks) sits one level up; spawned ranks inherit sys.path."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
