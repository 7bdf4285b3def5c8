"""Reuse of keys/values for shared prompt prefixes, in whole blocks of tokens.

A block is keyed by its tokens and everything before it (a hash chain), so a hit means the same prefix. The
stored values are the bits the model computed; with row-invariant ops a hit and a miss give the same logprobs.

A sliding-window layer whose cache is a ring (models.decoder.KVCache) keeps only its last positions: a block is
stored for it only while the ring still holds it (None otherwise), and a hit stops where such a layer lacks a
block that the positions after the hit still see.
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

    def _span(self, cache: KVCache, layer: int, b: int) -> slice:
        """The slots of block b in a layer's cache (a ring: positions modulo its slots)."""
        start = (b * self.block_tokens) % cache.k[layer].shape[2]
        return slice(start, start + self.block_tokens)

    def load(self, tokens: list[int], limit: int, cache: KVCache, slot: int) -> int:
        """Copy the longest usable cached prefix (at most `limit` tokens, whole blocks) into `slot`; return its
        length."""
        entries = []
        for key in self._keys(tokens, limit // self.block_tokens):
            entry = self._blocks.get(key)
            if entry is None:
                break
            self._blocks.move_to_end(key)
            entries.append(entry)
        hit = len(entries)
        while hit and not self._usable(entries, hit, cache):
            hit -= 1
        for b, (ks, vs) in enumerate(entries[:hit]):  # in position order: a ring ends up with the latest blocks
            for layer, (k, v) in enumerate(zip(ks, vs)):
                if k is not None:
                    span = self._span(cache, layer, b)
                    cache.k[layer][slot, :, span] = k
                    if v is not None:  # (None: the layer's values are its keys, a latent cache's one row)
                        cache.v[layer][slot, :, span] = v
        return hit * self.block_tokens

    def _usable(self, entries: list, hit: int, cache: KVCache) -> bool:
        """Does every ring layer have the blocks that positions from hit * block_tokens on can still see (its
        window back)?"""
        bt = self.block_tokens
        for layer, k in enumerate(cache.k):
            if k.shape[2] < cache.max_len:
                window = cache.windows[layer] if cache.windows else k.shape[2]
                first = max(0, (hit * bt - window + 1) // bt)
                if any(entries[b][0][layer] is None for b in range(first, hit)):
                    return False
        return True

    def store(self, tokens: list[int], cache: KVCache, slot: int) -> None:
        """Remember every whole block of `tokens`, whose keys/values are in `slot` (all of them written: a ring
        layer still holds the blocks of its last slots)."""
        bt = self.block_tokens
        for b, key in enumerate(self._keys(tokens, len(tokens) // bt)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            ks, vs = [], []
            for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
                held = b * bt >= len(tokens) - k.shape[2]
                span = self._span(cache, layer, b)
                ks.append(k[slot, :, span].clone() if held else None)
                vs.append(v[slot, :, span].clone() if held and v is not k else None)  # a latent row: held once
            self._blocks[key] = (ks, vs)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
