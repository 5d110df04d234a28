"""The rankscope contract: wire models, subjects, streams, settings and the embedded NATS."""
