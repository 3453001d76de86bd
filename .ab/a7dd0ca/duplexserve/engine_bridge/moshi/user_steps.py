"""A depformer that also predicts the user's stream, cut to the model's own.

PersonaPlex's checkpoint has 16 depformer steps for 16 audio codebooks: steps 0-7 sample
the agent's 8 codebooks, steps 8-15 predict the user's 8, and NVIDIA's ``LMGen`` always
replaces those predictions by the user's real tokens. Kyutai's ``LMGen`` with
``dep_q == n_q`` would instead expect no user tokens at all and never hear the user.

The depformer is causal over its steps, so steps 0-7 never see steps 8-15: dropping
them leaves every agent token exactly as it was (the tests compare with NVIDIA's 16-step
loop), halves the depformer's work, and makes the model a plain 8 + 8 Moshi for Kyutai's
``LMGen``. Chosen over forcing the user's tokens inside a 16-step depformer for that
half of its cost, with nothing to lose.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def drop_user_steps(lm: Any) -> bool:
    """Cut ``lm``'s depformer to the agent's steps when it also predicts the user's
    (``dep_q == n_q``); False when it does not. Call before streaming starts."""
    if lm.depformer is None or lm.dep_q != lm.n_q:
        return False
    keep = lm.n_q // 2
    attention = lm.depformer.layers[0].self_attn
    schedule = attention.weights_per_step_schedule
    sets = keep if not schedule else max(schedule[:keep]) + 1  # weight sets the kept steps use
    schedule = list(schedule[:keep]) if schedule else schedule
    lm.dep_q = keep
    if lm.depformer_weights_per_step_schedule:
        lm.depformer_weights_per_step_schedule = schedule
    if lm.depformer_multi_linear:
        lm.depformer_in = nn.ModuleList(list(lm.depformer_in)[:sets])
    lm.depformer_emb = nn.ModuleList(list(lm.depformer_emb)[: keep - 1])
    lm.depformer_norms = nn.ModuleList(list(lm.depformer_norms)[:keep])
    lm.linears = nn.ModuleList(list(lm.linears)[:keep])
    for layer in lm.depformer.layers:
        for module in (layer, layer.self_attn):
            module.weights_per_step = keep
            module.weights_per_step_schedule = schedule
        layer.self_attn.in_projs = nn.ModuleList(list(layer.self_attn.in_projs)[:sets])
        layer.self_attn.out_projs = nn.ModuleList(list(layer.self_attn.out_projs)[:sets])
        if isinstance(layer.gating, nn.ModuleList):
            layer.gating = nn.ModuleList(list(layer.gating)[:sets])
    return True
