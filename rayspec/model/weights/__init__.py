"""Where a model's weights come from and how they reach its parameters.

- hub: model specs (hub id `org/name[@revision]`, local directory, GGUF file, the default) resolved
  to a local directory, downloaded or converted as needed; configs read without the weights.
- files: which files of a checkpoint directory hold the weights (safetensors or pytorch_model*.bin,
  sharded or not).
- checkpoint: a checkpoint streamed tensor by tensor into a built model (rayspec.model.loader builds it).
"""
