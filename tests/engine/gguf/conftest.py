"""Makes the helper module beside these tests (gguf_isolation.py) importable in any pytest
import mode."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
