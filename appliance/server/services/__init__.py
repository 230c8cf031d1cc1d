"""The server's services: the rules behind the handlers."""
