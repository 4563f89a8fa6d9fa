"""Values: what a hook saw, held and described.

``keep`` turns a tensor a hook sees into one that can be kept (the keep policy), ``copy_on_write``
keeps it equal to what the module returned despite later in-place writes, ``kinds`` is the table of
tensor kinds every verb reads, ``layout`` says what a value holds (batch, token and heads axes,
the mask of its forward), ``record_key`` is the one address of a recorded value.
"""

__all__: list[str] = []
