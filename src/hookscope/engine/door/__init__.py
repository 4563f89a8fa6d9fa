"""The door: the only code that writes torch's hook tables.

``hooks`` registers and removes every hook hookscope adds, each owned (its module
object, its thread, not a checkpoint recompute; the decision taken once per forward);
``copies`` keeps every hook out of a copy, a pickle or a checkpoint of the model.
"""

__all__: list[str] = []
