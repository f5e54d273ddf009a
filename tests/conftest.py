import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (codec_cases, ...)

# The CUDA-simulator tests run in their own interpreter (tests/test_cuda_simulator.py).
collect_ignore = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["cudasim"]
