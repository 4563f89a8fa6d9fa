"""Feature circuits: sparse dictionaries (``dictionary``; ``sae``: SAEs and SAELens's folders;
``transcoder``: transcoders and circuit-tracer's files), splicing them into a model
(``splicing``), training them (``training``), the local replacement model's frozen forward
(``replacement``), attribution graphs (``graph``), their pruning (``pruning``) and
circuit-tracer's graph JSON (``graph_json``).

Imports ``editing``, ``store``, ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.circuits.dictionary import Dictionary
from hookscope.circuits.graph import Graph, attribution_graph
from hookscope.circuits.pruning import Pruned, prune
from hookscope.circuits.sae import SAE, load_sae
from hookscope.circuits.splicing import Splice, splice
from hookscope.circuits.training import Training, train_sae, train_transcoder
from hookscope.circuits.transcoder import Transcoder, load_transcoder

__all__ = ["Dictionary", "Graph", "Pruned", "SAE", "Splice", "Training", "Transcoder", "attribution_graph",
           "load_sae", "load_transcoder", "prune", "splice", "train_sae", "train_transcoder"]
