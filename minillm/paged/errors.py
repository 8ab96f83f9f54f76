"""The exceptions of the paged KV cache.

Every failure of the block manager is one of these, raised *before* anything changes: a
call that raises leaves the manager exactly as it was, so the scheduler can catch the
error, preempt or queue, and carry on. They all derive from `BlockManagerError`, so one
``except`` clause catches them all; each also derives from the built-in exception a Python
programmer would expect (``LookupError`` for an unknown sequence, ``ValueError`` for a
duplicate), so generic handlers keep working.
"""
from __future__ import annotations

__all__ = ["BlockManagerError", "OutOfBlocks", "RequestTooLong", "UnknownSequence", "DuplicateSequence"]


class BlockManagerError(Exception):
    """Base class of every error raised by `minillm.paged`."""


class OutOfBlocks(BlockManagerError):
    """The pool has too few blocks *right now*; freeing or preempting sequences would help.

    Attributes:
        needed: blocks the operation needs.
        available: blocks that could be handed out now (free plus evictable cached ones).
    """

    def __init__(self, what: str, needed: int, available: int, free: int, cached: int):
        self.needed, self.available = needed, available
        super().__init__(
            f"{what} needs {needed} new block(s) but only {available} can be handed out now "
            f"({free} free + {cached} unreferenced cached). Nothing was changed: free or preempt a "
            f"sequence and retry, or ask can_allocate()/can_append() before calling."
        )


class RequestTooLong(BlockManagerError):
    """A request needs more blocks than the *whole* pool holds: it can never be admitted.

    Waiting cannot help, so the scheduler must reject the request instead of queueing it.

    Attributes:
        needed: blocks the request needs.
        num_blocks: blocks in the whole pool.
    """

    def __init__(self, num_tokens: int, block_size: int, needed: int, num_blocks: int):
        self.needed, self.num_blocks = needed, num_blocks
        super().__init__(
            f"a request of {num_tokens} tokens needs {needed} blocks of {block_size} tokens, but the whole "
            f"pool has only {num_blocks} blocks ({num_blocks * block_size} tokens): it can never fit. "
            f"Reject it, or give the cache more memory."
        )


class UnknownSequence(BlockManagerError, LookupError):
    """No sequence with this id holds blocks (never allocated, or already freed)."""

    def __init__(self, seq_id, action: str):
        self.seq_id = seq_id
        super().__init__(
            f"cannot {action} sequence {seq_id!r}: the block manager holds no such sequence "
            f"(it was never allocated, or it was already freed)"
        )


class DuplicateSequence(BlockManagerError, ValueError):
    """A sequence id is already in use; ids must be unique among live sequences."""

    def __init__(self, seq_id, action: str):
        self.seq_id = seq_id
        super().__init__(
            f"cannot {action} sequence {seq_id!r}: that id already holds blocks. "
            f"Free it first, or pick a fresh id"
        )
