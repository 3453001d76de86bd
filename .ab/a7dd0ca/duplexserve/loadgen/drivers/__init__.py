"""Client drivers, one module per wire protocol.

A driver module ``drivers/<name>.py`` defines ``DRIVER``, a :class:`ClientDriver`
subclass; ``--protocol <name>`` finds it by that name, so adding a protocol is adding
its module and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from duplexserve.loadgen.drivers.base import ClientDriver, Sink


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")


def get_driver(name: str) -> type[ClientDriver]:
    if name not in available():
        raise ValueError(f"unknown protocol {name!r}; one of {', '.join(available())}")
    driver = importlib.import_module(f"{__name__}.{name}").DRIVER
    assert issubclass(driver, ClientDriver)
    return driver


__all__ = ["ClientDriver", "Sink", "available", "get_driver"]
