"""meshloom: train transformers with any mix of data, tensor, pipeline and context parallelism."""

__version__ = "0.1.0"
