"""Compile: the route of hooks through ``torch.compile`` graphs.

``graph`` holds the hooks a ``torch.compile(fullgraph=True)`` graph traces whole and every
process-wide change that route makes (dynamo's configuration, hookscope's ``torch.library``
operators), in one place the door test knows.
"""

__all__: list[str] = []
