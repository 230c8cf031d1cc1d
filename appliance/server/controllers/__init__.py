"""HTTP handlers: parse, call a service, return."""
