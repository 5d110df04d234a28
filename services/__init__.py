"""rankscope services: one package per service plus the `rankscope` command line."""
