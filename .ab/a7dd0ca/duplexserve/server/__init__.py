"""The WebSocket server: protocol adapters, the session core and the orchestrator."""
