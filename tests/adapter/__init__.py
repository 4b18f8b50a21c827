"""The HTTP adapter: shapes with the fake engine, end to end with the real one, the entrypoint."""
