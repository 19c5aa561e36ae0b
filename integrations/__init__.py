"""Adapters to the tools users already log with: W&B, TensorBoard, HuggingFace, Lightning, and
a JSON Lines file nnstat reads back itself (`JsonlLogger`)."""

from nnstat.integrations.jsonl import JsonlLogger

__all__ = ["JsonlLogger"]
