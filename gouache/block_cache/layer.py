"""The block-cache layer of a step's forward (`gouache.forward_layers`): the requests that ask
for reuse reuse block outputs across steps (PatchedServe), per image, patch or token; the layer
hands the model's forward the block pass (`CachedForward`) its blocks run through."""

from __future__ import annotations

from gouache.block_cache.blocks import CachedForward
from gouache.block_cache.store import BlockCache
from gouache.forward_layers import Inner, Predictions, RowMaps, Step


class BlockCacheLayer:
    technique = "block_cache"

    def __init__(self, cache: BlockCache | None):
        """`cache`: the block cache, when the step may reuse (degree 1: ranks must not decide apart)."""
        self.cache = cache

    def uses(self, step: Step, state) -> frozenset[str]:
        if self.cache is None or not self.cache.threshold(state.request.request_id, state.request.block_cache):
            return frozenset()
        return frozenset({"block_cache"})

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        return inner(step.of(step.states, blocks=CachedForward.of(step.states, self.cache)))

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        if any(self.uses(step, s) for s in step.states):
            return None  # a reused block computes a subset of rows: no segmenting there
        return inner.rows(step)
