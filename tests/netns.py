"""A network namespace with loopback only, for tests whose peers gather ICE candidates.

A browser's ICE gathers a host candidate on every interface and pairs each with the
server's candidates, so even a server that offers only 127.0.0.1 would be reached from
this machine's other addresses. Inside :func:`loopback_only` the calling thread, and
every process it starts from then on (the server, Playwright's driver and its
Chromium), see one interface, ``lo``: no packet can use another address.

Entering needs root (``unshare --net``, ``setns``); where that is refused the test is
skipped, as where Chromium is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """This thread in a fresh network namespace whose only interface, ``lo``, is up."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2)")
    holder = subprocess.Popen(
        ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep 3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert holder.stdout is not None
    if holder.stdout.readline() != b"up\n":
        holder.kill()
        holder.wait()
        pytest.skip("cannot make a network namespace here (unshare --net needs root)")
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    new = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY)
    try:
        try:
            _setns(new)
        except OSError as exc:
            pytest.skip(f"cannot enter a network namespace: {exc}")
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(new)
        holder.kill()
        holder.wait()
