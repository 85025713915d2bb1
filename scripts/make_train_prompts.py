#!/usr/bin/env python3
"""Write the project's own EAGLE training prompts into data/train/ (`--extra`: the pools' leftovers).

The generator is rayspec/eagle/prompt_pools.py and its lists are rayspec/data/prompt_pools/*.json;
this wrapper only runs it from the repository root, so the output lands in this checkout's
data/train/ wherever it is called from. Standard library only, fixed seed: the same files byte for byte.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rayspec.eagle.prompt_pools import main  # noqa: E402

if __name__ == "__main__":
    main(["--out-dir", str(ROOT / "data" / "train"), *sys.argv[1:]])
