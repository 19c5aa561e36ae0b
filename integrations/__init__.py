"""Adapters to the tools users already log with: W&B, TensorBoard, HuggingFace, Lightning."""
