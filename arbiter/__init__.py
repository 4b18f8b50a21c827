"""Arbiter's decision core: wire schema, errors, settings, prompt, model files and the engine.

Every entry point (``adapter`` over HTTP, ``worker`` over S3 and SQS, ``evaluation``, ``bench``,
``infra``) builds on this package; it imports none of them, nor any HTTP or AWS library
(tests/test_layering.py checks it).
"""
