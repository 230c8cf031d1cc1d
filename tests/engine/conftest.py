"""Helper modules beside the engine tests (sampler_ref.py) are importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
