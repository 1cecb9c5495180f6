"""Self-speculative decoding with the first MTP module (greedy; model.mtp.depth >= 1).

Shapes: one sequence, prompt (1, T0) -> (1, T0 + N). After the main model has read token x_t
(hidden state h_t before its final norm, greedy next token x_{t+1}), the MTP module drafts
d = argmax Head(RMSNorm(MTP(h_t, Emb(x_{t+1})))) for x_{t+2}. One main forward over
[x_{t+1}, d] then gives the main model's own choice after x_{t+1}: if it is d, the draft is
accepted and that forward's second position already gives x_{t+3} (two tokens for one forward);
if not, its choice replaces d and the cache drops d (per-position caches move their length back;
recurrent and Engram states are restored from a snapshot and x_{t+1} is read again). The output
is the main model's greedy continuation; the MTP module only decides how many forwards it takes.

The MTP module keeps its own cache: at each step it reads the main positions it has not seen,
each with the token that followed it, so its block attends over the same positions as in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model.mixers.kv_cache import Cache
from model.transformer import Transformer


@dataclass
class SpeculativeStats:
    drafted: int = 0  # drafts proposed
    accepted: int = 0  # drafts the main model agreed with
    main_forwards: int = 0  # main-model forwards after the prefill (verifications and re-reads)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class _Drafter:
    """The first MTP module with its own cache and the main positions it has not read yet."""

    def __init__(self, model: Transformer, capacity: int, dtype: torch.dtype) -> None:
        self.model, self.module = model, model.mtp.layers[0]
        device = model.embed.weight.device
        self.cache = Cache([self.module.block.new_state(1, capacity, dtype, device)], capacity)
        self.hidden: list[Tensor] = []  # (1, C) per unread main position
        self.following: list[Tensor] = []  # (1,) the token after each of them

    def push(self, hidden: Tensor, following: Tensor) -> None:
        """hidden (1, P, C) main states, following (1, P) the tokens after those positions."""
        self.hidden += list(hidden.unbind(1))
        self.following += list(following.unbind(1))

    def draft(self) -> Tensor:
        """(1,) the draft after the last pushed position's following token."""
        hidden = torch.stack(self.hidden, dim=1)
        tokens = torch.stack(self.following, dim=1)
        P, start = tokens.shape[1], self.cache.length
        self.cache.check_room(P)
        positions = torch.arange(start, start + P, device=tokens.device)[None]
        ctx = self.model._context(tokens, positions, start, None, hidden.dtype)
        _, normed = self.module(hidden, self.model.embed(tokens), ctx, self.cache.layers[0])
        self.cache.length += P
        self.hidden, self.following = [], []
        return F.linear(normed[:, -1], self.model.head_weight).argmax(-1)


def _main(model: Transformer, tokens: Tensor, cache: Cache) -> tuple[Tensor, Tensor]:
    """(hidden before the final norm (1, T, C), greedy next token at each position (1, T))."""
    trunk, _ = model._trunk(tokens, None, cache)
    return trunk, F.linear(model.norm(trunk), model.head_weight).argmax(-1)


@torch.no_grad()
def speculative_generate(
    model: Transformer, prompt: Tensor, max_new_tokens: int, *, eos_id: int | None = None
) -> tuple[Tensor, SpeculativeStats]:
    """The greedy continuation of `prompt` (1, T0), drafted by the first MTP module; stops at
    `eos_id` (included) or after `max_new_tokens`."""
    if model.mtp is None:
        raise ValueError("speculative decoding drafts with the MTP modules: model.mtp.depth is 0")
    if prompt.shape[0] != 1:
        raise ValueError(
            f"speculative decoding runs one sequence at a time; got a batch of {prompt.shape[0]}"
        )
    stats = SpeculativeStats()
    if max_new_tokens <= 0:
        return prompt, stats
    capacity = prompt.shape[1] + max_new_tokens + 2
    cache = model.new_cache(1, capacity)
    drafter = _Drafter(model, capacity, model.embed.weight.dtype)
    hidden, choice = _main(model, prompt, cache)
    current = choice[:, -1]  # x_{t+1}: emitted, not yet read by the main model
    drafter.push(hidden, torch.cat([prompt[:, 1:], current[:, None]], dim=1))
    emitted: list[Tensor] = []

    def done(token: Tensor) -> bool:
        return len(emitted) >= max_new_tokens or (eos_id is not None and int(token) == eos_id)

    while True:
        emitted.append(current)
        if done(current):
            break
        if len(emitted) + 1 == max_new_tokens:  # one token left: no room for a draft's position
            _, choice = _main(model, current[:, None], cache)
            stats.main_forwards += 1
            emitted.append(choice[:, -1])
            break
        draft = drafter.draft()
        snapshot = cache.snapshot()
        hidden, choice = _main(model, torch.stack([current, draft], dim=1), cache)
        stats.drafted, stats.main_forwards = stats.drafted + 1, stats.main_forwards + 1
        if int(choice[0, 0]) == int(draft):  # accepted: the draft, then the main model's next
            stats.accepted += 1
            emitted.append(draft)
            if done(draft):
                break
            drafter.push(hidden, torch.stack([draft, choice[:, 1]], dim=1))
            current = choice[:, 1]
            continue
        if cache.has_fixed_state:  # rejected: keep x_{t+1} only (recurrent states: read again)
            cache.restore(snapshot)
            hidden, _ = _main(model, current[:, None], cache)
            stats.main_forwards += 1
        else:
            cache.length -= 1
        drafter.push(hidden[:, :1], choice[:, :1])
        current = choice[:, 0]
    return torch.cat([prompt, torch.stack(emitted, dim=1)], dim=1), stats
