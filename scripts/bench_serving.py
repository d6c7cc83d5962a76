"""Serving benchmark against any OpenAI-compatible server; same as `sluice bench serve`.

python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 --num-prompts 200
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.bench_serve import main

if __name__ == "__main__":
    main()
