"""Every command README.md and docs/*.md show runs as written, and every link they make leads
somewhere (issue 54: a newcomer follows the pages before the code).

Each fenced ``sh`` and ``python`` block runs, in page order, unless the line before it says
``<!-- not run in CI: WHY -->``; those are reported as skipped with their reason, so what is
not run here is listed, never silent. docs/benchmarks-history.md is left out: it records the
commands as they ran on their commits.

The blocks run in a fresh copy of the tracked files, as a newcomer's clone. The README's first
block ("Run it": a venv, the package, the server) makes the copy's ``.venv``; a block naming
``.venv/bin/...`` uses that, a bare ``duplexserve`` or ``python`` the test suite's own venv (what
the README's second command, ``./scripts/test.sh``, installs). Two things are rewritten, and only
these: ``0.0.0.0`` becomes ``127.0.0.1`` (tests listen on loopback only) and the port 8998 a free
one (tests run side by side; a server left on its default port gets it as ``DUPLEXSERVE_PORT``).
A block whose last command is ``duplexserve serve`` must answer /health, then is stopped; any
other block that names port 8998 talks to an echo server the test started there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "docs" / "benchmarks-history.md"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != HISTORY)]
NOT_RUN = re.compile(r"<!-- not run in CI: (.+?) -->")
#: Blocks of pages this change may not edit today (another engineer's), with why they are not
#: run; the reason belongs in the page as ``<!-- not run in CI: ... -->`` once it can be added.
NOT_RUN_UNMARKED = {("docs/reliability.md", "duplexserve serve --port 8996 &"): "a 10-minute soak"}
DOC_PORT = "8998"
SERVE = re.compile(r"^(?:\S*/)?duplexserve serve\b[^&]*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    text: str
    not_run: str | None  # the reason, or None: it runs

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def serves(self) -> bool:
        """The block ends in a foreground ``duplexserve serve``: a server to start and stop."""
        commands = [c for c in self.text.replace("\\\n", " ").splitlines() if c.strip()]
        commands = [c for c in commands if not c.lstrip().startswith("#")]
        last = commands[-1].split("#")[0].strip() if commands else ""
        return self.lang == "sh" and bool(SERVE.match(last.split("&&")[-1].strip()))


def blocks(page: Path) -> list[Block]:
    """The page's ``sh`` and ``python`` blocks (other fences skipped whole: their lines are not
    commands), each with the reason it is not run, if any."""
    found: list[Block] = []
    lines = [line.strip() for line in page.read_text().splitlines()]
    name = str(page.relative_to(ROOT))
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = lines.index("```", i + 1)
        lang = lines[i][3:]
        if lang in ("sh", "python"):
            text = "\n".join(page.read_text().splitlines()[i + 1 : end]) + "\n"
            marked = NOT_RUN.search(lines[i - 1]) if i else None
            reason = marked.group(1) if marked else NOT_RUN_UNMARKED.get((name, lines[i + 1]))
            found.append(Block(name, i + 1, lang, text, reason))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in blocks(page)]
RUN_IT = BLOCKS[0]  # the README's first block: "Run it"


def rewrite(text: str, port: int) -> str:
    """Loopback, and a port of this test's own; nothing else changes."""
    return re.sub(rf"\b{DOC_PORT}\b", str(port), text.replace("0.0.0.0", "127.0.0.1"))


def block_env(copy: Path, port: int | None = None) -> dict[str, str]:
    """The test suite's venv first on PATH (bare ``duplexserve``), the copy's code imported, and
    nothing of this process's own settings: no ``DUPLEXSERVE_*`` or OpenAI variable leaks in.
    ``port``: where a server the block starts on the default port listens instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXSERVE_", "OPENAI_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(copy)
    if port is not None:
        env["DUPLEXSERVE_PORT"] = str(port)
    return env


def health(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    return False


@contextlib.contextmanager
def serving(block: Block, copy: Path, timeout: float) -> Iterator[tuple[int, Path]]:
    """Run a block that ends in a foreground server, until its /health answers; stop it after."""
    port = free_port()
    log = copy / f"block-{block.line}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", rewrite(block.text, port)],
            cwd=copy, env=block_env(copy, port), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while not health(port):
            assert proc.poll() is None, f"{block.id} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{block.id}: no /health:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield port, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the block's own process group: bash and its server
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in log.read_text(), f"{block.id}:\n{log.read_text()[-3000:]}"


@dataclass
class FreshClone:
    path: Path
    #: what commands needing an extra said in the fresh venv, before any extra was installed
    without_extras: dict[str, subprocess.CompletedProcess[str]]
    webrtc_without_extra: httpx.Response


#: A fresh venv and its packages, then a block's own installs: minutes on a loaded machine.
SLOW = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory) -> FreshClone:
    """The tracked files copied, then the README's "Run it" run in them as written: a fresh
    venv, the package, a server that answers /health. While that venv has no extra, the commands
    that need one are tried, and WebRTC asked of its server."""
    copy = tmp_path_factory.mktemp("clone")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    with serving(RUN_IT, copy, timeout=600) as (port, _):
        url = f"ws://127.0.0.1:{port}"
        tries = {
            "loadgen": [".venv/bin/duplexserve", "loadgen", url, "-c", "1", "-n", "1x", "--seconds", "1"],
            "bench": [".venv/bin/duplexserve", "bench", "rtf", "--short"],
        }
        env = block_env(copy)
        without = {
            extra: subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
            for extra, argv in tries.items()
        }
        offer = httpx.post(
            f"http://127.0.0.1:{port}/v1/realtime/calls", content=b"v=0\r\n",
            headers={"Content-Type": "application/sdp"}, timeout=10,
        )  # fmt: skip
    return FreshClone(copy, without, offer)


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The server the pages' client commands talk to: ``duplexserve serve``, the echo engine."""
    from tests.conftest import start_server

    server = start_server(str(tmp_path_factory.mktemp("docs-server")), "--max-sessions", "64")
    yield server
    server.stop()


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats -1, -2."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"^#{1,6} (.+)$", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_leads_to_a_file_and_heading_the_repository_has():
    broken = []
    for page in [*PAGES, HISTORY]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_makes_the_clients_in_wav_and_names_what_the_setup_needs(tmp_path):
    """A newcomer had no ``in.wav`` for the ten-line client, met libopus only in a log line,
    and could not tell which tests skip for want of what ``.ci/run`` installs."""
    from duplexserve.check.requirements import INSTALL_LIBOPUS

    readme = [b for b in BLOCKS if b.page == "README.md"]
    client = next(i for i, b in enumerate(readme) if 'src="in.wav"' in b.text)
    maker = next(b for b in reversed(readme[:client]) if "in.wav" in b.text and not b.not_run)
    done = subprocess.run(["bash", "-e", "-c", maker.text], cwd=tmp_path, env=block_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with wave.open(str(tmp_path / "in.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getnframes() / w.getframerate()) == (1, 2, 2.0)
    text = (ROOT / "README.md").read_text()
    setup, _, tests = text.partition("## Test it")
    assert INSTALL_LIBOPUS.partition(" (")[0] in " ".join(setup.split())  # as check says it
    tests = tests.partition("\n## ")[0]
    named = re.findall(r"`(tests/[\w*]+\.py)`", tests)
    assert len(named) >= 8 and all(list(ROOT.glob(n)) for n in named), named
    for package in ("chromium", "nginx", "coturn", "prometheus", "espeak-ng"):
        assert package in tests.lower() and package in (ROOT / ".ci" / "run").read_text(), package


def test_protocols_md_counts_the_protocols_its_table_lists():
    """It said "all three protocols" above a table of four."""
    text = (ROOT / "docs" / "protocols.md").read_text()
    table = text.partition("| path | protocol |")[2].partition("\n\n")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 4, rows
    for word in ("two", "three", "five"):
        assert not re.search(rf"\b(all {word}|{word} protocols)\b", text, flags=re.IGNORECASE), word


def test_every_variable_compose_reads_is_on_its_page_with_its_default():
    """DUPLEXSERVE_MOSHI_PRESET=tiny, compose's default, was missing from the variables table."""
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    page = (ROOT / "docs" / "deploy-compose.md").read_text()
    read = dict(re.findall(r"\$\{(DUPLEXSERVE_\w+):-([^}]*)\}", compose))
    assert len(read) > 20 and not [name for name in read if not re.search(rf"\b{name}\b", page)]
    for name in ("DUPLEXSERVE_MOSHI_PRESET", "DUPLEXSERVE_DEVICE", "DUPLEXSERVE_IDLE_TIMEOUT_S"):
        assert f"| `{name}` | `{read[name]}` |" in page, name


def test_the_repository_cites_only_files_it_has():
    """The design files the project follows are not in the repository: its docs state what they
    take from them (docs/protocol.md the wire contract, docs/benchmarks.md's Definitions,
    docs/architecture.md), and every page, comment and docstring cites those."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    cites = re.compile(r"\b(?:BENCHMARKS|PROTOCOL|ARCHITECTURE)\.md\b")
    found = []
    for name in tracked.stdout.splitlines():
        with contextlib.suppress(UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            text = (ROOT / name).read_text()
            found += [f"{name}: {m}" for m in cites.findall(text)]
    assert not found, "\n".join(found)


def test_the_benchmarks_tables_serve_command_is_what_its_bench_command_starts():
    """Each row of docs/benchmarks.md's first table: the ``serve`` command it gives is the one
    ``bench moshi-rtf`` with the row's arguments prints (less what changes nothing measured:
    every bucket captured before ready, the port, the idle timeout)."""
    from duplexserve.bench import command
    from duplexserve.bench.moshi import serve_arguments

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("|") and "bench moshi-rtf " in line]
    assert len(rows) >= 10
    for row in rows:
        serve, bench = re.findall(r"`(duplexserve (?:serve|bench) [^`]+)`", row)
        argv = serve_arguments(parser.parse_args(bench.split()[2:]))
        assert argv[-4:] == ["--port", "18990", "--idle-timeout-s", "120"]
        assert serve.split()[1:] == argv[:-4], row


@SLOW
def test_a_command_missing_its_extra_says_which_in_one_line(fresh_clone):
    """The README's install has no extra: what needs one says which, in one line, no traceback."""
    for extra, done in fresh_clone.without_extras.items():
        said = done.stdout + done.stderr
        assert "Traceback" not in said and f"[{extra}]" in said, f"{extra}:\n{said[-3000:]}"
        assert len(done.stderr.strip().splitlines()) == 1, f"{extra}:\n{done.stderr[-3000:]}"
    answer = fresh_clone.webrtc_without_extra
    assert answer.status_code == 501 and "[webrtc]" in answer.json()["error"]["message"], answer.text


@SLOW
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs_as_written(block: Block, request):
    if block.not_run:
        pytest.skip(f"{block.id} not run in CI: {block.not_run}")
    copy = request.getfixturevalue("fresh_clone").path
    if block is RUN_IT:
        return  # fresh_clone ran it: the venv is made and its server answered /health
    if block.serves:
        with serving(block, copy, timeout=600):
            return
    port = request.getfixturevalue("doc_server").port if DOC_PORT in block.text else free_port()
    if block.lang == "python":
        write_speech(copy / "in.wav", rate=22050)  # what the ten-line client reads: not 24 kHz
        argv = [sys.executable, "-c", rewrite(block.text, port)]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", rewrite(block.text, port)]
    done = subprocess.run(argv, cwd=copy, env=block_env(copy), capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in said, f"{block.id} ({done.returncode}): {said[-4000:]}"
    if (copy / "out.wav").exists():  # the ten-line client: the answer is as long as the input
        with wave.open(str(copy / "out.wav")) as w:
            seconds = w.getnframes() / w.getframerate()
        assert SPEECH_S <= seconds <= SPEECH_S + 0.08, seconds  # up to one 80 ms frame padded
        (copy / "out.wav").unlink()


SPEECH_S = 2.0


def write_speech(path: Path, seconds: float = SPEECH_S, rate: int = 24000) -> None:
    """A mono 16-bit WAV at ``rate``: a tone, then silence."""
    t = np.arange(int(rate * seconds)) / rate
    pcm = (8000 * np.sin(2 * np.pi * 220 * t) * (t < seconds / 2)).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
