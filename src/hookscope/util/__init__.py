"""Helpers with no knowledge of hooks, used by every layer: tensors in nested structures
(``nested``), atomic files (``files``), optional dependencies (``extras``), PNG figures
(``figures``). Imports nothing of hookscope but ``errors``."""

from hookscope.util.extras import require
from hookscope.util.figures import DPI, FIGURE_SIZE_PX, new_figure, save_figure
from hookscope.util.files import (
    advice,
    check_new_file,
    read_regular,
    write_all,
    write_atomic,
    write_bytes,
)
from hookscope.util.nested import (
    Keys,
    describe_keys,
    get_part,
    heads_part,
    iter_tensors,
    iter_tensors_with_keys,
    map_tensors,
    map_tensors_with_keys,
    set_part,
)

__all__ = ["DPI", "FIGURE_SIZE_PX", "Keys", "advice", "check_new_file", "describe_keys", "get_part",
           "heads_part",
           "iter_tensors", "iter_tensors_with_keys", "map_tensors", "map_tensors_with_keys", "new_figure",
           "read_regular", "require",
           "save_figure", "set_part", "write_all", "write_atomic", "write_bytes"]
