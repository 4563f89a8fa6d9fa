"""Activations of whole data sets on disk or in object storage: ``extraction`` (``extract``),
``shard_loop`` (the loop), ``batch_rows`` (a batch's rows), ``batches`` (what a data argument
means), ``ranks`` (torchrun), ``ray_engine`` (Ray actors write shards, the driver lists them),
``writer`` (shards and manifests), ``folder`` (which files
of an output folder belong to a store), ``manifest`` (the schema), ``reader`` (``Store``),
``shards`` (a shard file read through its chunk checksums), ``layers`` (a layer's rows),
``tokens`` (token views and the shuffled token stream), ``probes`` (linear probes on a store) and
``fs`` (where the files live: a local folder or any fsspec URL, ``s3://``, ``memory://``). The
format is in docs/extraction.md.

Imports ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.store.extraction import SHARD_BYTES, SHARD_SECONDS, extract
from hookscope.store.folder import check_output
from hookscope.store.fs import location
from hookscope.store.layers import LayerInfo, LayerView, StoreDataset, dtype_name
from hookscope.store.probes import ProbeResult, probe
from hookscope.store.ray_engine import RayEngine
from hookscope.store.reader import FORMAT, Store, open_store, read_manifest
from hookscope.store.shards import ShardInfo, chunk_sums
from hookscope.store.tokens import TokenLoader, TokenStream, TokenView, pad_rows

__all__ = ["FORMAT", "LayerInfo", "LayerView", "ProbeResult", "RayEngine", "SHARD_BYTES", "SHARD_SECONDS",
           "ShardInfo", "Store", "StoreDataset", "TokenLoader", "TokenStream", "TokenView",
           "check_output", "chunk_sums",
           "dtype_name", "extract", "location", "open_store", "pad_rows", "probe", "read_manifest"]
