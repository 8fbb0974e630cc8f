"""Collectives and their ledger: the only package that talks to torch.distributed."""

from lightning_zero.comm.collectives import Communicator, Handle, is_distributed
from lightning_zero.comm.ledger import CommLedger, CommRecord, OpTotals, wire_bytes

__all__ = ["CommLedger", "CommRecord", "Communicator", "Handle", "OpTotals", "is_distributed", "wire_bytes"]
