"""A prompt's frames through the LM's transformer at once, on a scratch row, in CUDA graphs.

A prefill is one forward of one session's prompt (``prompts.py``), run between two steps
of the live sessions, so its time is added to theirs. Launched op by op it is bound by
the host (about 70 kernels a layer: 63 ms for a 312-frame prompt of a 7B model on an
H200, of which 21 ms on the GPU). Here it runs on a state of its own, one row with a
ring as long as the context (``_init_streaming_state(1)`` of every streaming module of
the transformer), as CUDA graphs captured for a few lengths: the prompt is padded to
the next of them, and only its own positions are copied into the session's row (the
padding's keys never leave the scratch ring). Where graphs cannot run (the CPU, a prompt
longer than the largest length) the same forward runs op by op on the same scratch row.

Padding changes the matmuls' shapes, so a bf16 prefix can differ from the unpadded
forward's by bf16 rounding (personaplex-7b on the H200, 131 frames padded to 256: keys
and values within 2% of their largest magnitude; 311 padded to 512: identical).
"""

from __future__ import annotations

from typing import Any

import torch
from moshi.modules.streaming import StreamingModule

from .live_lm import ring_prefix

# The captured prompt lengths, in frames: a prompt pads to the next (a 313-frame one ran in
# 42 ms padded to 512 on the H200, launched op by op in 63).
LENGTHS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)


class Prefill:
    """The scratch row and its graphs for ``lm``; build after the LM's own streaming state."""

    def __init__(self, lm: Any, graphs: bool) -> None:
        self.lm = lm
        transformer = lm.transformer
        self.modules = [m for m in transformer.modules() if isinstance(m, StreamingModule)]
        self.states = [m._init_streaming_state(1) for m in self.modules]
        self.attention = [self.states[self.modules.index(layer.self_attn)] for layer in transformer.layers]
        self.offsets = self.states[self.modules.index(transformer)].offsets
        context = transformer.layers[0].self_attn.context
        param = next(lm.parameters())
        self.lengths = [n for n in LENGTHS if n <= context] if graphs and param.is_cuda else []
        longest = max(self.lengths, default=0)
        self.x = torch.zeros((1, longest, lm.dim), device=param.device, dtype=param.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.lengths:
            pool = torch.cuda.graph_pool_handle()
            for n in reversed(self.lengths):  # the largest first: the smaller ones fit in its pool
                self.graphs[n] = self._capture(n, pool)

    def run(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` (``[1, T, dim]``, the prompt's input embeddings) through the transformer from
        position 0: the keys and values it leaves in each layer (``ring_prefix``)."""
        n = x.shape[1]
        length = next((m for m in self.lengths if m >= n), None)
        if length is None:
            with self._scratch():
                self.offsets.zero_()
                self.lm.transformer(x)
        else:
            self.x[:, :n] = x
            self.x[:, n:length] = 0.0
            self.graphs[length].replay()
        return ring_prefix(self.attention, 0, n)

    def _forward(self, n: int) -> None:
        with self._scratch():
            self.offsets.zero_()
            self.lm.transformer(self.x[:, :n])

    def _capture(self, n: int, pool: Any) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(n)  # the kernels' first run (their choices, workspaces) is not captured
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward(n)
        return graph

    def _scratch(self) -> Any:
        return _Swapped(self.modules, self.states)


class _Swapped:
    """``modules`` on ``states`` for the duration of a ``with``, their own states after."""

    def __init__(self, modules: list[StreamingModule], states: list[Any]) -> None:
        self.modules, self.states = modules, states

    def __enter__(self) -> None:
        self.saved = [m._streaming_state for m in self.modules]
        for module, state in zip(self.modules, self.states, strict=True):
            module._streaming_state = state

    def __exit__(self, *exc: object) -> None:
        for module, state in zip(self.modules, self.saved, strict=True):
            module._streaming_state = state
