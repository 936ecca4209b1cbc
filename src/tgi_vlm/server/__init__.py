"""gRPC edge of the shard: the servicer, the batch cache and the socket/signal lifecycle."""
