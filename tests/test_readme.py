"""The README's examples run as written: every block marked ``<!-- test: run -->`` (shell),
``<!-- test: python -->`` or ``<!-- test: file NAME -->`` (written to NAME) is run in order, in one
shell, in a fresh folder, with the installed ``mlscale`` on the PATH."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

MARKED = re.compile(r"<!-- test: (run|python|file (\S+)) -->\n```[^\n]*\n(.*?)```", re.S)


def readme_script(text: str) -> str:
    """One bash script of the marked blocks, in the README's order."""
    parts = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for kind, filename, body in MARKED.findall(text):
        if kind == "run":
            parts.append(body)
        elif kind == "python":
            parts.append(f"python3 - <<'README_PYTHON'\n{body}README_PYTHON")
        else:
            parts.append(f"cat > {filename} <<'README_FILE'\n{body}README_FILE")
    return "\n".join(parts) + "\n"


def test_the_marked_blocks_are_found():
    kinds = [kind.split()[0] for kind, _, _ in MARKED.findall((REPO / "README.md").read_text())]
    assert kinds.count("run") >= 5 and "python" in kinds and "file" in kinds


TRACE = ".readme-trace"  # each command as it starts, with the time: what a timeout names


@pytest.mark.timeout(1700)
def test_every_marked_readme_block_runs_as_written(tmp_path):
    shutil.copytree(REPO / "examples", tmp_path / "examples")  # the README runs from a checkout's root
    script = readme_script((REPO / "README.md").read_text())
    script = f"exec 9> {TRACE}; BASH_XTRACEFD=9; PS4='+ $(date +%T) '; set -x\n{script}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLSCALE_REGISTRY", None)
    env.pop("PYTHONPATH", None)
    # Output to files, not pipes: a process that outlived the script must not hold the test open.
    with open(tmp_path / ".stdout", "w+") as out, open(tmp_path / ".stderr", "w+") as err:
        shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=out, stderr=err,
                                 text=True, start_new_session=True)
        try:
            shell.wait(timeout=1500)  # about 200 s alone; the suite's other workers share the 2 cores
            left = _outlived(shell.pid, grace_s=30)
        except subprocess.TimeoutExpired:
            left = None
        finally:  # whatever happened: no server, worker or training job of the README outlives the test
            running = _group(shell.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    trace = "\n".join((tmp_path / TRACE).read_text().splitlines()[-15:])
    assert left is not None, f"timed out; the last commands:\n{trace}\nstill running:\n{running}\n{stderr[-2000:]}"
    assert not left, f"still running 30 s after the script ended (SIGTERM sent):\n{left}"
    result = subprocess.CompletedProcess(shell.args, shell.returncode, stdout, stderr)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    out = result.stdout
    assert "registered  models:/digits/1" in out and "champion" in out
    assert out.count('"model_name":"digits"') >= 2  # the v2 infer and the /predict answers
    assert re.search(r"digit \d\n", out)  # the class taken from the scores
    assert "mlscale: worker rank 1 was killed at step 120" in result.stderr
    assert (tmp_path / "runs/cnn/report.json").exists() and (tmp_path / "runs/py/report.json").exists()
    for layout in ("ddp x4", "fsdp 4", "fsdp 2 x tp 2", "pipeline 2"):  # mlscale plan: the user's Llama
        assert f"\n{layout} " in out, layout
    llama = json.loads((tmp_path / "runs/llama-fsdp-tp/report.json").read_text())
    assert llama["world_size"] == 4 and llama["workers"] == 2  # 2 data shards x 2 tensor-parallel ranks
    assert (tmp_path / "runs/llama-pipeline/report.json").exists()
    assert "v2 (canary)" in out and "digits v2: every check passed" in out  # the rollout's comparison
    assert "160 samples trained, 160 distinct: each once" in out  # your own data: killed, resumed on 3 workers
    assert "160 of 160 images trained, each once" in out  # your images: the same, with data workers and crops
    assert re.search(r"\n\[\d+ prompt tokens, \d+ generated\]\n", out)  # generate: streamed through openai
    assert '"model_name":"storyteller"' in out and '"text_output":' in out  # and the OIP generate


def _group(pgid: int) -> str:
    """The processes of the script's process group, one per line (empty when none)."""
    listing = subprocess.run(["ps", "-o", "pid=,etime=,args=", "-g", str(pgid)], capture_output=True, text=True)
    return listing.stdout.strip()


def _outlived(pgid: int, grace_s: float) -> str:
    """What of the script's processes is still running ``grace_s`` after it ended (its EXIT trap sent each
    background job SIGTERM)."""
    deadline = time.monotonic() + grace_s
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
