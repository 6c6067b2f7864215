"""The loaders layer, between training and the models: materialising components and a run's trained modules
(loaders.components), the structure fine-tuning adds and how it folds back (loaders.adapters), and a run's
pipeline (loaders.pipelines). Apart from the models, as diffusers keeps its loaders."""
