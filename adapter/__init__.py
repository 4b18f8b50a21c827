"""The HTTP adapter (aiohttp): the SageMaker inference container and the local decision API.

``app`` builds the app and holds the route table; one module per route family (``invocations``,
``jsonlines``, ``chat``, ``systemone``, ``execution``); ``middleware`` turns every error into its
response. It imports the core (``arbiter``) and no other entry point.
"""
