"""Reuse of keys/values for shared prompt prefixes, in whole blocks of tokens.

A block is keyed by its tokens and everything before it (a hash chain), so a hit means the same prefix. The
stored values are the bits the model computed; with row-invariant ops a hit and a miss give the same logprobs.
"""
from __future__ import annotations

import collections

import torch

from nemo_rz.models.decoder import KVCache


class PrefixCache:
    def __init__(self, block_tokens: int = 16, max_blocks: int = 4096):
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: collections.OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()

    def _keys(self, tokens: list[int], n_blocks: int):
        key = 0
        for b in range(n_blocks):
            key = hash((key, tuple(tokens[b * self.block_tokens : (b + 1) * self.block_tokens])))
            yield key

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)

    def load(self, tokens: list[int], limit: int, cache: KVCache, slot: int) -> int:
        """Copy the longest cached prefix (at most `limit` tokens, whole blocks) into `slot`; return its length."""
        bt, hit = self.block_tokens, 0
        for b, key in enumerate(self._keys(tokens, limit // bt)):
            entry = self._blocks.get(key)
            if entry is None:
                break
            self._blocks.move_to_end(key)
            for layer, (k, v) in enumerate(zip(*entry)):
                cache.k[layer][slot, :, b * bt : (b + 1) * bt] = k
                cache.v[layer][slot, :, b * bt : (b + 1) * bt] = v
            hit = (b + 1) * bt
        return hit

    def store(self, tokens: list[int], cache: KVCache, slot: int) -> None:
        """Remember every whole block of `tokens`, whose keys/values are in `slot`."""
        bt = self.block_tokens
        for b, key in enumerate(self._keys(tokens, len(tokens) // bt)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            span = slice(b * bt, (b + 1) * bt)
            ks = torch.stack([k[slot, :, span] for k in cache.k]).clone()
            vs = torch.stack([v[slot, :, span] for v in cache.v]).clone()
            self._blocks[key] = (ks, vs)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
