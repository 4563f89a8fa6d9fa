"""Naming: from the names users see to modules and calls.

``selection`` resolves paths, ``state_dict()`` keys, globs and ``re:`` patterns; ``names`` maps every
name a user can see to one canonical path and ``wrappers`` sees through wrapper modules;
``standard_naming`` gives the same addresses on every transformer; ``function_names`` names the
function calls inside a forward and the addresses that select them.
"""

__all__: list[str] = []
