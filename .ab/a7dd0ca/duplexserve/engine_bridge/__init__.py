"""The engine side: the engine interface, its implementations and the bridge into them."""

from duplexserve.engine_bridge.bridge import EngineBridge, StepOutput
from duplexserve.engine_bridge.engine import Engine, StepResult

__all__ = ["Engine", "EngineBridge", "StepOutput", "StepResult"]
