"""The message board agents coordinate through: ideas and claim-once (NATS JetStream); results
are the ledger's, not the board's."""

from kiln.board.client import Board
from kiln.board.post import BoardPost

__all__ = ["Board", "BoardPost"]
