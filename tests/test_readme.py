"""The README's quick start runs: every bash and python block of its "Quick start" section, against a real server
(the converted SmolLM2, as `make serve` serves it) at the README's address rewritten to the test server's, exits 0
and prints something. So the README cannot rot; docs/API.md's field tables are what scripts/api_doc.py writes."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def quick_start() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    section = section[: section.index("\n## ", 1)]
    return BLOCK.findall(section)


def test_the_quick_start_has_every_example():
    blocks = quick_start()
    code = "\n".join(body for _, body in blocks)
    assert [kind for kind, _ in blocks].count("bash") >= 1 and len(blocks) >= 5
    for needle in ("stream=True", "json_schema", "tool_choice", "break", "responses.create", "previous_response_id"):
        assert needle in code, needle


@pytest.mark.parametrize("i", range(len(quick_start())))
async def test_a_quick_start_block_runs(real_server, i):
    kind, body = quick_start()[i]
    body = body.replace("http://127.0.0.1:8000", real_server.url)
    argv = ["bash", "-euo", "pipefail", "-c", body] if kind == "bash" else [sys.executable, "-c", body]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.strip(), err.decode()[-2000:]


def test_the_api_reference_is_generated():
    from scripts.api_doc import PATH, text

    assert PATH.read_text() == text(), "run: python scripts/api_doc.py"
