"""
The per-layer registry of the NTK engines: one module per layer kind, each giving what both the exact kernel engine
(:mod:`art_malleability.ntk.empirical`) and the projection (:mod:`art_malleability.ntk.projection`) need, after
kronfluence's one tracked module per layer type.

- :mod:`~art_malleability.ntk.layers.base`: a :class:`~art_malleability.ntk.layers.base.Site` (one tracked module:
  its calls' checks, where probes go, what a pass keeps, its factors), the
  :class:`~art_malleability.ntk.layers.base.Block` (a weight and bias with a Kronecker-factored Jacobian) and the
  input sides of blocks (dense, grouped, token indices);
- one module per kind: :mod:`~art_malleability.ntk.layers.linear`, :mod:`~art_malleability.ntk.layers.conv`,
  :mod:`~art_malleability.ntk.layers.embedding`, :mod:`~art_malleability.ntk.layers.norm` (batch, layer, group and RMS
  norms), :mod:`~art_malleability.ntk.layers.attention` (multi-head attention, and ``scaled_dot_product_attention``
  written out), :mod:`~art_malleability.ntk.layers.recurrent` (LSTM, GRU, RNN), and
  :mod:`~art_malleability.ntk.layers.module` (any other module with parameters of its own: the batched path of its own
  parameters);
- :mod:`~art_malleability.ntk.layers.plan`: the registry's order of kinds (:data:`~art_malleability.ntk.layers.plan.
  KINDS`) and the probe pass that plans a model (sites, uses of every parameter, fallback parameters);
- :mod:`~art_malleability.ntk.layers.passes`: the class-batched pass that gives every site's factors at once.

A new kind is one module here (a :class:`~art_malleability.ntk.layers.base.Site` subclass: ``types``, ``check``,
``keep`` or ``probed_forward``, ``factors``) and one entry in :data:`~art_malleability.ntk.layers.plan.KINDS`; both
engines take it from there. Each kind is tested against the whole-batch ``torch.func`` Jacobian
(``tests/test_ntk_layers.py``).
"""
