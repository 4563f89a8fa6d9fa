"""Activations of whole data sets on disk: ``extract`` (the loop), ``data`` (what a data
argument means), ``ranks`` (torchrun), ``writer`` (shards and manifests), ``folder`` (which
files of an output folder belong to a store), ``manifest`` (the schema), ``reader``
(``Store``), ``tokens`` (token views and the shuffled token stream) and ``fs`` (where the files
live: a local folder or any fsspec URL, ``s3://``, ``memory://``). The format is in the README.

Imports ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.store.reader import (
    FORMAT,
    LayerInfo,
    LayerView,
    ShardInfo,
    Store,
    StoreDataset,
    chunk_sums,
    dtype_name,
    open_store,
    read_manifest,
)
from hookscope.store.tokens import TokenStream, TokenView, pad_rows

__all__ = ["FORMAT", "LayerInfo", "LayerView", "ShardInfo", "Store", "StoreDataset", "chunk_sums",
           "dtype_name", "open_store", "pad_rows", "read_manifest", "TokenStream", "TokenView"]
