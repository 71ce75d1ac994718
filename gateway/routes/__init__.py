"""Thin HTTP route modules: parse, call the layer below, shape the response."""
