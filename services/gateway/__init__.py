"""The HTTP gateway: the API, the web timeline and streams, with no state of its own."""
