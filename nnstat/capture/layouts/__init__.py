"""Model layouts beyond "one row per sample in dim 0, one module per parameter".

* ``broadcast.py``: inputs the batch shares (position ids ``[1, T]`` or ``[T]``, a ``[T, T]``
  table), expanded to the batch so their modules' per-sample gradients are exact;
* ``ambiguous.py``: such inputs when ``T`` equals the batch size, checked at their first uses;
* ``tied.py``: parameters shared by several modules (tied embeddings), captured once;
* ``foreign.py``: parameters the forward also uses outside their module (a tie by hand,
  ``F.linear(h, emb.weight)``), whose modules are left out;
* ``hooks.py``: the engine's hooks that apply these (and ``nn.MultiheadAttention``'s).
"""
