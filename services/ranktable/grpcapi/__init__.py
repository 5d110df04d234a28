"""Generated gRPC modules for ClusterD's `config.Config` service (`make proto`)."""
