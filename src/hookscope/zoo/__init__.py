"""Real models and real inputs for the CLI and the demo: model specs (``models``), inputs
(``inputs``), predictions and pictures (``viz``). Loaded only when asked for: ``import
hookscope`` never imports this package (nor transformers, PIL or matplotlib).

Imports every layer below the CLI.
"""

from hookscope.zoo.data import load_data
from hookscope.zoo.inputs import Inputs, expand_folder, load_inputs, read_tensor_file
from hookscope.zoo.models import LoadedModel, load_model
from hookscope.zoo.predictions import Prediction, predict
from hookscope.zoo.viz import attention_grid, plan_png_files, plot_activations

__all__ = ["Inputs", "LoadedModel", "Prediction", "attention_grid", "expand_folder", "load_data",
           "load_inputs", "load_model", "plan_png_files", "plot_activations", "predict", "read_tensor_file"]
