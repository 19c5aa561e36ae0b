"""Model layouts beyond "one row per sample in dim 0, one module per parameter".

* ``broadcast.py``: inputs the batch shares (position ids ``[1, T]`` or ``[T]``, a ``[T, T]``
  table), expanded to the batch so their modules' per-sample gradients are exact;
* ``ambiguous.py``: such inputs when ``T`` equals the batch size, checked at their first uses;
* ``tied.py``: parameters shared by several modules (tied embeddings), captured once;
* ``hooks.py``: the engine's hooks that apply these (and ``nn.MultiheadAttention``'s).
"""
