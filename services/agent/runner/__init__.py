"""The runner process: one rank of a pipeline-parallel MLX model, recording every phase."""
