"""Compile: the route of hooks through ``torch.compile`` graphs.

``graph`` holds the hooks a ``torch.compile(fullgraph=True)`` graph traces whole and every
process-wide change that route makes (dynamo's configuration, hookscope's ``torch.library``
operators), in one place the door test knows. ``spec`` writes a value as the tensors and spec
string such a graph hands out; ``function_calls`` hands out the calls of a watched forward
(``engine.function_mode``) that dynamo traces.
"""

__all__: list[str] = []
