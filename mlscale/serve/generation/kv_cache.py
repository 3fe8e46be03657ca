"""The paged KV cache: fixed-size blocks handed out from one pool, and the prefix cache over them.

BlockPool does the bookkeeping only (which block holds what, who uses it); the tensors the blocks
index live in the runner (KVStore), so the scheduler can decide a step without touching torch.

Prefix caching, as vLLM keys it: a full block's key is a digest of its tokens and its parent block's
key, so equal keys mean equal tokens at equal positions from the start of the sequence, and the K/V a
block holds depend on nothing else. A block nobody uses keeps its key and its contents until it is
needed for something else, least recently freed first; a later request whose prompt starts with the
same tokens takes those blocks instead of computing them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

ROOT_KEY = b""


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its tokens and its parent's key (ROOT_KEY for a sequence's first)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(",".join(map(str, tokens)).encode())
    return digest.digest()


def prefix_keys(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_KEY, start: int = 0) -> list[bytes]:
    """The keys of every full block of ``tokens`` from block ``start`` on (``parent``: the key before it)."""
    keys = []
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[begin : begin + block_size])
        keys.append(parent)
    return keys


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each.

    A block is in use (reference count > 0: held by running sequences, shared when its key matched)
    or free. A free block without a key is reused first; a free block with one waits in ``_lru`` in the
    order it was freed, still there for a prefix hit, until an allocation needs it (oldest first).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._refs = [0] * num_blocks
        self._keys: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries_total = 0
        self.hits_total = 0

    @property
    def free_blocks(self) -> int:
        return len(self._plain) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks (keyless ones first, then the least recently freed cached ones, whose
        keys are forgotten); the caller checks ``free_blocks`` first."""
        if count > self.free_blocks:
            raise RuntimeError(f"{count} blocks asked for, {self.free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._plain:
                block = self._plain.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._cached[self._keys[block]]
                self._keys[block] = None
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free (its key kept). Freed
        last to first so that a sequence's tail is reused before its head, which a longer prefix needs."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._keys[block] is None:
                    self._plain.append(block)
                else:
                    self._lru[block] = None

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the first, each now held once more.
        Counted in queries_total / hits_total (blocks)."""
        if not self.prefix_caching:
            return []
        self.queries_total += len(keys)
        blocks = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
            blocks.append(block)
        self.hits_total += len(blocks)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """``block`` is full and holds the tokens ``key`` names: later prompts may share it. A key
        already held by another block stays with that one."""
        if self.prefix_caching and self._keys[block] is None and key not in self._cached:
            self._cached[key] = block
            self._keys[block] = key

    def unmatch(self, blocks: Sequence[int], queries: int) -> None:
        """Give back what ``match_prefix`` took (``queries`` keys looked up), uncounted: the sequence
        was not admitted after all."""
        self.free(blocks)
        self.queries_total -= queries if self.prefix_caching else 0
        self.hits_total -= len(blocks)
