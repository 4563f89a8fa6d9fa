"""The engine: the only code that touches torch's hook API.

``hooks`` is the one door to torch's registration (every hook hookscope adds is owned: its own
module object, its own thread, not a checkpoint recompute, never in a copy); ``session`` is the
life cycle every verb shares (resolve once, register, remove on every exit path, explain unfired
hooks); ``select``, ``names`` and ``wrappers`` turn patterns into modules; ``function_mode`` and
``function_names`` reach the torch functions a forward calls; ``early_stop`` cuts a forward short;
``values`` and ``copy_on_write`` hold a value a hook saw; ``layout`` says what a value holds
(token and heads axes, the mask and KV-cache length of its forward), for every verb; ``run`` is
what a batch means to the model; ``diagnose`` says why a hook could not or did not fire.

Imports only ``hookscope.errors`` and ``hookscope.util``.
"""
