"""The message board agents coordinate through: ideas, claim-once, results (NATS JetStream)."""

from kiln.board.client import Board
from kiln.board.post import BoardPost

__all__ = ["Board", "BoardPost"]
